"""Build a role's manager from the node's ``TransferConfig`` (what node launch code calls).

Both node roles build their manager here, so the data plane, the bootstrap client and the
close-on-failure rule are written once::

    args = node_kv_args(kv_pool, state_pool, aux, host)       # what this rank registers
    build_prefill_manager(tc, args, bootstrap_url)            # or build_decode_manager(tc, args)

Either returns a manager that owns its data plane; if the manager cannot be built, the data
plane is closed before the error propagates.
"""
from __future__ import annotations

from common import envs
from common.config import TransferConfig
from common.kvcache.pool import KVPool
from common.kvcache.state_pool import StatePool

from transfer.args import KVArgs
from transfer.aux import AuxPool
from transfer.base import BootstrapClient, DataPlane
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.prefill import PrefillKVManager
from transfer.registry import create_data_plane


def node_kv_args(kv_pool: KVPool, state_pool: StatePool | None, aux: AuxPool, host: str,
                 tp_rank: int = 0, tp_size: int = 1, *, total_kv_heads: int | None = None,
                 staging_pages: int = 0) -> KVArgs:
    """What a node rank registers and tells its peers: its KV pool (its own KV heads), its
    recurrent-state pool (hybrid models; ``None`` otherwise) and its aux rows, reachable at
    ``host``, as TP rank ``tp_rank`` of ``tp_size``.

    ``total_kv_heads``: the model's KV heads (without it a rank of ``tp_size`` > 1 serves or
    receives only its own TP size; pairs of other sizes are refused at lookup). ``staging_pages``
    > 0 lets the rank serve or receive another TP size (``transfer.staging``): a prefill rank's
    per-worker arena (a chunk larger goes in pieces), a decode rank's staging area (as many pages
    as its KV pool never runs out). The pool tensors go along for the gather and scatter; equal
    TP never touches them."""
    return KVArgs(layout=kv_pool.layout, kv=KVArgs.kv_from_pool(kv_pool),
                  state=KVArgs.state_from_pool(state_pool),
                  state_layout=None if state_pool is None else state_pool.layout,
                  aux=aux.buffers(), aux_top_k=aux.top_k, host=host, tp_rank=tp_rank, tp_size=tp_size,
                  total_kv_heads=total_kv_heads, kv_tensors=tuple(kv_pool.buffers()), staging_pages=staging_pages)


def _data_plane(tc: TransferConfig, host: str, **options: object) -> DataPlane:
    # Only the mooncake backend reads these; the others ignore unknown options.
    return create_data_plane(tc.backend, host=host, protocol=envs.MOONCAKE_PROTOCOL.get(),
                             device=envs.MOONCAKE_DEVICE.get(), **options)


def _default_client() -> BootstrapClient:
    from transfer.bootstrap import HttpBootstrapClient

    return HttpBootstrapClient()


def build_prefill_manager(
    tc: TransferConfig, args: KVArgs, bootstrap_addr: str, bootstrap: BootstrapClient | None = None,
    **overrides: float,
) -> PrefillKVManager:
    """``bootstrap_addr``: this node's bootstrap server (``http://host:port``), where the rank registers.

    The prefill's data plane is the one that writes, so it gets the write timeout: how long one
    engine write may block on a hung decode (``PDC_MOONCAKE_TRANSFER_TIMEOUT_S``)."""
    engine = _data_plane(tc, args.host, transfer_timeout_s=tc.write_timeout_s)
    try:
        cfg = KVManagerConfig.from_transfer_config(tc, **overrides)
        return PrefillKVManager(args, engine, bootstrap or _default_client(), bootstrap_addr, cfg)
    except BaseException:
        engine.close()
        raise


def build_decode_manager(
    tc: TransferConfig, args: KVArgs, bootstrap: BootstrapClient | None = None, **overrides: float
) -> DecodeKVManager:
    """The decode's data plane never writes (the prefill writes into its pages): no write timeout."""
    engine = _data_plane(tc, args.host)
    try:
        cfg = KVManagerConfig.from_transfer_config(tc, **overrides)
        return DecodeKVManager(args, engine, bootstrap or _default_client(), cfg)
    except BaseException:
        engine.close()
        raise
