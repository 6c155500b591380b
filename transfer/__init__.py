"""KV cache transfer between prefill and decode nodes.

Public API::

    KVPoll                                  per-room state (transfer.poll)
    KVArgs, BufferSet                       what a manager moves (transfer.args)
    AuxPool, AuxRecord                      first token + logprobs rows (transfer.aux)
    KVManagerConfig                         timeouts, heartbeats, workers (transfer.config)
    create_data_plane(name, host, **opts)   backend registry: "mooncake", "fake"
    PrefillKVManager(args, engine, bootstrap, bootstrap_addr, config).create_sender(room)
    DecodeKVManager(args, engine, bootstrap, config).create_receiver(room, bootstrap_addr)
    build_prefill_manager(transfer_config, args, bootstrap_addr) / build_decode_manager(...)
                                            the same, engine and HTTP bootstrap client included
    KVSender / KVReceiver                   the per-room contracts (transfer.base)
    TransferError

The managers are imported lazily (they pull in zmq and the bootstrap client).
"""
from typing import Any

from transfer.args import BufferSet, KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.base import BootstrapClient, DataPlane, KVReceiver, KVSender
from transfer.config import KVManagerConfig
from transfer.errors import TransferError
from transfer.poll import KVPoll
from transfer.registry import available_backends, create_data_plane

_LAZY = {
    "PrefillKVManager": "transfer.prefill",
    "DecodeKVManager": "transfer.decode",
    "HttpBootstrapClient": "transfer.bootstrap",
    "build_prefill_manager": "transfer.factory",
    "build_decode_manager": "transfer.factory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'transfer' has no attribute {name!r}")


__all__ = [
    "AuxPool", "AuxRecord", "BootstrapClient", "BufferSet", "DataPlane", "DecodeKVManager", "HttpBootstrapClient",
    "KVArgs", "KVManagerConfig", "KVPoll", "KVReceiver", "KVSender", "PrefillKVManager", "TransferError",
    "available_backends", "build_decode_manager", "build_prefill_manager", "create_data_plane",
]
