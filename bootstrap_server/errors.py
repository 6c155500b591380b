"""Errors of the bootstrap registry, one hierarchy so a caller can catch ``BootstrapError``.

::

    BootstrapError            the server answered with an error, or an unusable answer
    ├── BootstrapUnreachable  no answer at all: refused, reset, timed out, bad address
    ├── RankNotRegistered     404: the rank (or, for the layout, any rank) is not registered
    └── LayoutMismatch        a decode cannot receive this prefill's KV (raised locally)
"""
from __future__ import annotations


class BootstrapError(Exception):
    """An error talking to a bootstrap server; ``reason`` is the server's own words when it gave any."""

    def __init__(self, reason: str, *, url: str | None = None, status: int | None = None) -> None:
        self.reason = reason
        self.url = url
        self.status = status
        where = f" ({url}" + (f", HTTP {status}" if status is not None else "") + ")" if url else ""
        super().__init__(f"{reason}{where}")


class BootstrapUnreachable(BootstrapError):
    """The server could not be reached (connection refused or reset, timeout, DNS failure)."""


class RankNotRegistered(BootstrapError):
    """The server is up but the requested rank has not registered (yet), or has deregistered."""


class LayoutMismatch(BootstrapError):
    """A decode cannot receive a prefill's KV cache; the message names every differing field."""
