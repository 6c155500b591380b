"""Backend registry: names from configuration -> data-plane classes, imported lazily.

Lazy so that a node configured with ``fake`` never imports mooncake (or CUDA), and a missing
optional dependency fails with a clear error only when that backend is chosen.
"""
from __future__ import annotations

import importlib

from transfer.base import DataPlane
from transfer.errors import TransferError

_BACKENDS: dict[str, str] = {
    "mooncake": "transfer.backends.mooncake:MooncakeDataPlane",
    "fake": "transfer.backends.fake:FakeDataPlane",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_data_plane(name: str, host: str, **options: object) -> DataPlane:
    """Build the data plane ``name`` bound to ``host`` (options are backend-specific)."""
    target = _BACKENDS.get(name)
    if target is None:
        raise TransferError(f"unknown transfer backend {name!r}; expected one of {available_backends()}")
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(host=host, **options)
