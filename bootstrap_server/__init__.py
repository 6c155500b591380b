"""Bootstrap registry: prefill ranks register where they listen, decode ranks look them up.

Server side: ``BootstrapServer`` (own thread, embedded in a prefill process),
``AsyncBootstrapServer`` (inside a running loop), ``python -m bootstrap_server`` (standalone).
Client side: the functions of ``bootstrap_server.client`` (its docstring is the API contract),
the wire types of ``bootstrap_server.schema`` and ``check_receivable`` for the decode.

The server classes are imported lazily so that client users (transfer threads) do not pay
for importing aiohttp.
"""
from typing import Any
from bootstrap_server.client import (
    bootstrap_url,
    deregister,
    health,
    list_ranks,
    lookup_layout,
    lookup_rank,
    register_rank,
)
from bootstrap_server.errors import BootstrapError, BootstrapUnreachable, LayoutMismatch, RankNotRegistered
from bootstrap_server.registry import Registry, RegistryConflict
from bootstrap_server.schema import DecodeLayout, PrefillLayout, RankInfo, check_receivable

_LAZY = {"AsyncBootstrapServer", "BootstrapServer", "make_app"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from bootstrap_server import server

        return getattr(server, name)
    raise AttributeError(f"module 'bootstrap_server' has no attribute {name!r}")

__all__ = [
    "AsyncBootstrapServer",
    "BootstrapError",
    "BootstrapServer",
    "BootstrapUnreachable",
    "DecodeLayout",
    "LayoutMismatch",
    "PrefillLayout",
    "RankInfo",
    "RankNotRegistered",
    "Registry",
    "RegistryConflict",
    "bootstrap_url",
    "check_receivable",
    "deregister",
    "health",
    "list_ranks",
    "lookup_layout",
    "lookup_rank",
    "make_app",
    "register_rank",
]
