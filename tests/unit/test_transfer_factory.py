"""transfer/factory.py: both node roles build their KV args and managers through it."""
from __future__ import annotations

import numpy as np
import pytest

from common.config import TransferConfig
from common.kvcache.pool import KVPool
from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    LAYOUT,
    Cluster,
    MemoryBootstrap,
    cluster,
    handshake,
    make_side,
    until_terminal,
)
from transfer import factory
from transfer.aux import AuxPool
from transfer.backends.fake import FakeDataPlane
from transfer.factory import build_decode_manager, build_prefill_manager, node_kv_args
from transfer.poll import KVPoll


def test_factory_builds_managers_from_transfer_config(cluster: Cluster) -> None:
    tc = TransferConfig(backend="fake", bootstrap_timeout_s=1.0, heartbeat_interval_s=0.1)
    pm = build_prefill_manager(tc, make_side().args, ADDR, cluster.boot)
    cluster.managers.append(pm)
    dm = build_decode_manager(tc, make_side().args, cluster.boot, tick_s=0.01)
    cluster.managers.append(dm)
    assert pm.engine.name == "fake" and pm.config.bootstrap_timeout_s == 1.0 and dm.config.tick_s == 0.01
    sender, recv = handshake(pm, dm, room=1, dst_pages=[3])
    sender.send(np.array([2]), last_chunk=True)
    assert until_terminal(recv)[0] is KVPoll.Success


def test_only_the_writing_side_gets_the_write_timeout(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    options: list[dict] = []

    def plane(name: str, host: str, **opts: object) -> FakeDataPlane:
        options.append({"name": name, "host": host, **opts})
        return FakeDataPlane(host=host)

    monkeypatch.setattr(factory, "create_data_plane", plane)
    tc = TransferConfig(backend="fake", write_timeout_s=7.0)
    cluster.managers.append(build_prefill_manager(tc, make_side().args, ADDR, cluster.boot))
    cluster.managers.append(build_decode_manager(tc, make_side().args, cluster.boot))
    prefill, decode = options
    assert prefill["transfer_timeout_s"] == 7.0 and "transfer_timeout_s" not in decode
    assert prefill["name"] == decode["name"] == "fake" and "protocol" in prefill and "device" in decode


def test_a_manager_that_cannot_start_closes_its_data_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []

    class Plane(FakeDataPlane):
        def close(self) -> None:
            closed.append(True)
            super().close()

    class Refusing(MemoryBootstrap):
        def register_rank(self, url: str, info: object) -> None:  # type: ignore[override]
            raise ConnectionRefusedError("bootstrap server not up")

    monkeypatch.setattr(factory, "create_data_plane", lambda *a, **kw: Plane())
    with pytest.raises(Exception, match="bootstrap server not up"):
        build_prefill_manager(TransferConfig(backend="fake"), make_side().args, ADDR, Refusing())
    assert closed == [True]


def test_node_kv_args_describe_the_pools() -> None:
    pool = KVPool(LAYOUT, num_pages=8, device="cpu")
    aux = AuxPool(3, top_k=2)
    args = node_kv_args(pool, None, aux, "10.0.0.1")
    assert args.layout == LAYOUT and args.host == "10.0.0.1" and args.aux_top_k == 2
    assert len(args.kv) == 2 * LAYOUT.num_layers and len(args.aux) == len(aux.buffers())
    assert len(args.state) == 0 and args.state_layout is None
