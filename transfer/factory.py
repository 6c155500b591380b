"""Build a role's manager from the node's ``TransferConfig`` (what node launch code calls)."""
from __future__ import annotations

from common import envs
from common.config import TransferConfig

from transfer.args import KVArgs
from transfer.base import BootstrapClient
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.prefill import PrefillKVManager
from transfer.registry import create_data_plane


def _engine_options() -> dict[str, object]:
    # Only the mooncake backend reads these; the others ignore unknown options.
    return {"protocol": envs.MOONCAKE_PROTOCOL.get(), "device": envs.MOONCAKE_DEVICE.get()}


def _default_client() -> BootstrapClient:
    from transfer.bootstrap import HttpBootstrapClient

    return HttpBootstrapClient()


def build_prefill_manager(
    tc: TransferConfig, args: KVArgs, bootstrap_addr: str, bootstrap: BootstrapClient | None = None,
    **overrides: float,
) -> PrefillKVManager:
    """``bootstrap_addr``: this node's bootstrap server ("host:port"), where the rank registers."""
    engine = create_data_plane(tc.backend, host=args.host, **_engine_options())
    try:
        cfg = KVManagerConfig.from_transfer_config(tc, **overrides)
        return PrefillKVManager(args, engine, bootstrap or _default_client(), bootstrap_addr, cfg)
    except BaseException:
        engine.close()
        raise


def build_decode_manager(
    tc: TransferConfig, args: KVArgs, bootstrap: BootstrapClient | None = None, **overrides: float
) -> DecodeKVManager:
    engine = create_data_plane(tc.backend, host=args.host, **_engine_options())
    try:
        return DecodeKVManager(args, engine, bootstrap or _default_client(), KVManagerConfig.from_transfer_config(tc, **overrides))
    except BaseException:
        engine.close()
        raise
