"""The two KV managers in one process, for transfer tests: the fake data plane, an in-memory
bootstrap registry, a ``cluster`` fixture that closes every manager and checks no transfer
thread outlives it, and the waits a scheduler would do (used by test_transfer_*.py)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from bootstrap_server.errors import BootstrapUnreachable, RankNotRegistered
from bootstrap_server.registry import Registry
from bootstrap_server.schema import PrefillLayout, RankInfo
from common.kvcache.pool import KVLayout, KVPool
from transfer.args import KVArgs
from transfer.aux import AuxPool
from transfer.backends.fake import FakeDataPlane
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.poll import KVPoll
from transfer.prefill import PrefillKVManager

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
ADDR = "127.0.0.1:1"  # bootstrap address key of the in-memory registry
CFG = KVManagerConfig.defaults(
    bootstrap_timeout_s=1.0, waiting_timeout_s=1.0, heartbeat_interval_s=0.1, heartbeat_max_failures=3,
    num_workers=2, max_batch_entries=2000, hung_peer_quarantine_s=0.5, tick_s=0.01,
)


class MemoryBootstrap:
    """The bootstrap client contract over in-memory registries (one per address)."""

    def __init__(self) -> None:
        self.registries: dict[str, Registry] = {}

    def register_rank(self, url: str, info: RankInfo) -> None:
        self.registries.setdefault(url, Registry()).register(info)

    def deregister_rank(self, url: str, info: RankInfo) -> None:
        self.registries[url].deregister(info.dp_group, info.engine_rank, instance_id=info.instance_id)

    def lookup_layout(self, url: str) -> PrefillLayout:
        reg = self.registries.get(url)
        if reg is None:
            raise BootstrapUnreachable("bootstrap server unreachable: connection refused", url=url)
        layout = reg.layout()
        if layout is None:
            raise RankNotRegistered("no rank registered", url=url, status=404)
        return layout

    def lookup_rank(self, url: str, engine_rank: int, dp_group: int) -> RankInfo:
        info = self.lookup_layout(url) and self.registries[url].lookup(dp_group, engine_rank)
        if info is None:
            raise RankNotRegistered("rank not registered", url=url, status=404)
        return info


@dataclass
class Side:
    pool: KVPool
    aux: AuxPool
    engine: FakeDataPlane
    args: KVArgs


def make_side(layout: KVLayout = LAYOUT, top_k: int = 2) -> Side:
    pool = KVPool(layout, num_pages=16, device="cpu")
    aux = AuxPool(4, top_k=top_k)
    args = KVArgs(layout=layout, kv=KVArgs.kv_from_pool(pool), aux=aux.buffers(), aux_top_k=top_k)
    return Side(pool, aux, FakeDataPlane(), args)


@dataclass
class Cluster:
    boot: MemoryBootstrap = field(default_factory=MemoryBootstrap)
    managers: list[PrefillKVManager | DecodeKVManager] = field(default_factory=list)

    def prefill(self, side: Side | None = None, cfg: KVManagerConfig = CFG) -> tuple[PrefillKVManager, Side]:
        side = side or make_side()
        mgr = PrefillKVManager(side.args, side.engine, self.boot, ADDR, cfg)
        self.managers.append(mgr)
        return mgr, side

    def decode(self, side: Side | None = None, cfg: KVManagerConfig = CFG) -> tuple[DecodeKVManager, Side]:
        side = side or make_side()
        mgr = DecodeKVManager(side.args, side.engine, self.boot, cfg)
        self.managers.append(mgr)
        return mgr, side


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        for mgr in c.managers:
            mgr.close()
        leaked = [t.name for t in threading.enumerate() if t.name.startswith("pdc-")]
        assert not leaked, f"threads left running: {leaked}"


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def until_terminal(obj: object, timeout: float = 5.0) -> tuple[KVPoll, float]:
    """Poll like a scheduler (checking monotonicity) until terminal; return (state, seconds)."""
    t0, seen = time.monotonic(), KVPoll.Bootstrapping
    while True:
        st = obj.poll()  # type: ignore[attr-defined]
        assert st is KVPoll.Failed or st >= seen, f"poll went back from {seen.name} to {st.name}"
        seen = st
        if st.terminal:
            return st, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"stuck in {st.name}"
        time.sleep(0.002)


def handshake(pm: PrefillKVManager, dm: DecodeKVManager, room: int, dst_pages: list[int], aux_slot: int | None = 0):
    sender = pm.create_sender(room)
    recv = dm.create_receiver(room, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init(dst_pages, aux_slot)
    assert recv.poll() is KVPoll.Transferring
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    return sender, recv
