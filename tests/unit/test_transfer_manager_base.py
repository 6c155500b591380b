"""transfer/manager_base.py: the start-up and teardown both KV managers share.

Each case runs against both roles: a start-up that fails after the control plane opened closes
it and raises TransferError naming the role; ``close()`` joins the threads, closes the plane and
then the engine, once; a thread that does not stop leaks the engine instead of unregistering
memory under it, and says so under the role's own logger.
"""
from __future__ import annotations

import logging
import threading

import pytest

from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    Cluster,
    MemoryBootstrap,
    cluster,
    make_side,
)
from transfer import manager_base
from transfer.backends.fake import FakeDataPlane
from transfer.decode import DecodeKVManager
from transfer.errors import TransferError
from transfer.manager_base import KVManagerBase
from transfer.prefill import GOODBYE_FLUSH_S, PrefillKVManager
from transfer.zmq_io import ControlPlane

ROLES = ("prefill", "decode")


class CountingPlane(FakeDataPlane):
    def __init__(self, refuse_register: bool = False) -> None:
        super().__init__()
        self.refuse_register = refuse_register
        self.closes = 0

    def register(self, ptr: int, nbytes: int) -> None:
        if self.refuse_register:
            raise OSError("cannot pin memory")
        super().register(ptr, nbytes)

    def close(self) -> None:
        self.closes += 1
        super().close()


def build(role: str, engine: CountingPlane, boot: MemoryBootstrap) -> KVManagerBase:
    args = make_side().args
    if role == "prefill":
        return PrefillKVManager(args, engine, boot, ADDR, CFG)
    return DecodeKVManager(args, engine, boot, CFG)


def pdc_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pdc-")]


@pytest.mark.parametrize("role", ROLES)
def test_a_failed_registration_abandons_the_plane(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    planes: list[ControlPlane] = []

    class Recorded(ControlPlane):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)  # type: ignore[arg-type]
            planes.append(self)

    monkeypatch.setattr(manager_base, "ControlPlane", Recorded)
    boot = MemoryBootstrap()
    with pytest.raises(TransferError, match=f"^{role} transfer manager failed to start: cannot pin memory$"):
        build(role, CountingPlane(refuse_register=True), boot)
    (plane,) = planes
    assert plane.pull.closed and plane.ctx.closed  # socket and context closed, not left to the GC
    assert not pdc_threads()  # no thread was started
    assert not boot.registries  # the prefill never got as far as registering its rank


@pytest.mark.parametrize("role", ROLES)
def test_close_closes_the_plane_then_the_engine_once(role: str, cluster: Cluster) -> None:
    engine = CountingPlane()
    mgr = build(role, engine, cluster.boot)
    cluster.managers.append(mgr)
    assert pdc_threads() and engine.registered
    mgr.close()
    mgr.close()  # idempotent
    assert engine.closes == 1 and not pdc_threads()
    assert mgr._plane.ctx.closed
    if role == "prefill":  # and the rank left the registry, so decodes stop finding it
        assert cluster.boot.registries[ADDR].layout() is None


@pytest.mark.parametrize("role", ROLES)
def test_a_stuck_thread_leaks_the_engine(role: str, cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    engine = CountingPlane()
    mgr = build(role, engine, cluster.boot)
    cluster.managers.append(mgr)
    plane = mgr._plane
    real_join, real_close = plane.join, plane.close
    asked: dict[str, float] = {}

    def join(timeout_s: float) -> list[str]:
        asked["join"] = timeout_s
        real_join(timeout_s)
        return ["pdc-stuck"]  # as if a thread had not returned from an engine call

    def close(flush_s: float = 0.0) -> None:
        asked["flush"] = flush_s
        real_close(flush_s=flush_s)

    plane.join, plane.close = join, close  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR):
        mgr.close()
    assert engine.closes == 0 and engine.registered  # memory left registered under the "stuck" thread
    (rec,) = [r for r in caplog.records if "did not stop" in r.getMessage()]
    assert rec.name == f"transfer.{role}" and "pdc-stuck" in rec.getMessage()
    # The role's wind-down decides the bounds: the prefill waits out a hung write and lets its
    # goodbyes leave; the decode owes no one a message.
    if role == "prefill":
        assert asked == {"join": max(10.0, CFG.hung_peer_quarantine_s + 1.0), "flush": GOODBYE_FLUSH_S}
    else:
        assert asked == {"join": 10.0, "flush": 0.0}
