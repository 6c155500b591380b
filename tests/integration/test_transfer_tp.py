"""KV transfer between TP groups, per rank: one manager and one data plane per rank, all in this
process, through a real bootstrap server over HTTP.

Each prefill rank's pool holds a known value at every element, a function of (buffer, page, offset
in page, global KV head, dim), so what a decode rank must hold after a room is computable from the
plan alone: its own global heads, from the room's source pages, in its destination pages, and
zeros everywhere else. Backends: ``loopback`` (the fake data plane, but copying the bytes: every
engine lives in this process; it also logs each write, so who wrote the aux rows is visible) and
real Mooncake over TCP for the pairs that matter most (2 -> 1 scatters, 1 -> 2 gathers).

Refusals: pairs that cannot be served fail at lookup with ``LayoutMismatch`` naming the field, in
under a second, and every prefill rank's sender fails with them (both sides end idle).
"""
from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from bootstrap_server.heads import rank_heads
from bootstrap_server.server import BootstrapServer
from common.kvcache.pool import KVLayout, KVPool
from common.kvcache.state_pool import StateLayout, StatePool
from transfer.args import KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.backends.fake import FakeDataPlane
from transfer.base import DataPlane
from transfer.bootstrap import HttpBootstrapClient
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.descriptors import Descriptors, merge_runs
from transfer.factory import node_kv_args
from transfer.poll import KVPoll
from transfer.prefill import PrefillKVManager
from transfer.tp_map import plan

pytestmark = pytest.mark.integration

LAYERS, PAGE, DIM, PAGES = 2, 4, 4, 16
BUFFERS = 2 * LAYERS
CFG = KVManagerConfig.defaults(bootstrap_timeout_s=5.0, waiting_timeout_s=10.0, heartbeat_interval_s=0.2,
                               heartbeat_max_failures=3, hung_peer_quarantine_s=0.5, tick_s=0.01, num_workers=2)
# One staging page per prefill worker: a 3-page chunk of a gathered slice goes in two pieces, so
# the arena fills and is written out mid-group.
PREFILL_STAGING = 1


class LoopbackDataPlane(FakeDataPlane):
    """The fake data plane, but it copies: every engine is in this process, so a write is a
    ``memmove`` between registered regions (checked: a stray descriptor fails the write)."""

    regions: ClassVar[dict[str, list[tuple[int, int]]]] = {}

    def __init__(self, host: str = "127.0.0.1", **_: object) -> None:
        super().__init__(host)
        self.regions[self.session_id] = []
        self.log: list[tuple[str, int, int]] = []  # (peer session, dst address, bytes)

    def register(self, ptr: int, nbytes: int) -> None:
        super().register(ptr, nbytes)
        self.regions[self.session_id].append((ptr, nbytes))

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        mine, theirs = self.regions[self.session_id], self.regions.get(peer_session, [])
        inside = lambda regs, a, n: any(p <= a and a + n <= p + size for p, size in regs)  # noqa: E731
        if not all(inside(mine, s, n) and inside(theirs, d, n) for s, d, n in zip(desc.src, desc.dst, desc.lens)):
            return False
        if not super().write(peer_session, desc):
            return False
        for s, d, n in zip(desc.src, desc.dst, desc.lens):
            ctypes.memmove(d, s, n)
            self.log.append((peer_session, d, n))
        return True

    def close(self) -> None:
        self.regions.pop(self.session_id, None)
        super().close()


def make_engine(backend: str) -> DataPlane:
    if backend == "loopback":
        return LoopbackDataPlane()
    pytest.importorskip("mooncake.engine")
    from transfer.backends.mooncake import MooncakeDataPlane

    return MooncakeDataPlane("127.0.0.1", protocol="tcp", transfer_timeout_s=5.0)


def code(b: int | torch.Tensor, page: torch.Tensor, off: torch.Tensor, head: torch.Tensor, total: int) -> torch.Tensor:
    """The value every prefill pool holds at (buffer, page, offset, global head, dim): exact in float32."""
    dim = torch.arange(DIM)
    return ((((b * PAGES + page) * PAGE + off) * total + head) * DIM + dim).to(torch.float32)


@dataclass
class Rank:
    mgr: PrefillKVManager | DecodeKVManager
    pool: KVPool
    aux: AuxPool
    engine: DataPlane
    first_head: int


@dataclass
class Group:
    backend: str
    url: str
    prefills: list[Rank] = field(default_factory=list)
    decodes: list[Rank] = field(default_factory=list)


def kv_args(tp: int, rank: int, total: int, staging: int, layout: dict | None = None,
            state: StateLayout | None = None) -> tuple[KVArgs, KVPool, AuxPool]:
    heads = rank_heads(tp, total, rank)
    lay = KVLayout(**{**dict(num_layers=LAYERS, num_kv_heads=heads.count, head_dim=DIM, page_size=PAGE,
                             dtype="float32"), **(layout or {})})
    pool, aux = KVPool(lay, PAGES, "cpu"), AuxPool(4, top_k=2)
    states = None if state is None else StatePool(state, 4, "cpu")
    args = node_kv_args(pool, states, aux, "127.0.0.1", tp_rank=rank, tp_size=tp, total_kv_heads=total,
                        staging_pages=staging)
    return args, pool, aux


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer("127.0.0.1", 0)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def groups() -> Iterator[list[Group]]:
    made: list[Group] = []
    try:
        yield made
    finally:
        for g in made:
            for r in [*g.decodes, *g.prefills]:
                r.mgr.close()
        leaked = [t.name for t in threading.enumerate() if t.name.startswith("pdc-")]
        assert not leaked, f"threads left running: {leaked}"


def start(groups: list[Group], url: str, backend: str, tp_p: int, tp_d: int, total: int,
          decode_total: int | None = None, decode_staging: int = PAGES, prefill: dict | None = None,
          decode: dict | None = None, state: StateLayout | None = None) -> Group:
    g = Group(backend, url)
    groups.append(g)
    client = HttpBootstrapClient(lookup_timeout_s=2.0)
    for p in range(tp_p):
        args, pool, aux = kv_args(tp_p, p, total, PREFILL_STAGING, prefill, state)
        first = rank_heads(tp_p, total, p).first
        heads = torch.arange(first, first + args.layout.num_kv_heads)
        for b, t in enumerate(pool.buffers()):
            t.view(PAGES, PAGE, -1, DIM)[:] = code(b, torch.arange(PAGES)[:, None, None, None],
                                                   torch.arange(PAGE)[None, :, None, None], heads[None, None, :, None],
                                                   total)
        engine = make_engine(backend)
        g.prefills.append(Rank(PrefillKVManager(args, engine, client, url, CFG), pool, aux, engine, first))
    dt = decode_total or total
    for d in range(tp_d):
        args, pool, aux = kv_args(tp_d, d, dt, decode_staging, decode, state)
        engine = make_engine(backend)
        g.decodes.append(Rank(DecodeKVManager(args, engine, client, CFG), pool, aux, engine,
                              rank_heads(tp_d, dt, d).first))
    return g


def wait_all(handles: list, state: KVPoll, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(h.poll() is state for h in handles):
        bad = [(h.room, h.poll().name, h.failure_reason) for h in handles if h.poll() is KVPoll.Failed]
        assert not bad, f"failed: {bad}"
        assert time.monotonic() < deadline, f"not all {state.name}: {[h.poll().name for h in handles]}"
        time.sleep(0.005)


@dataclass(frozen=True)
class RoomSpec:
    room: int
    src: list[int]  # prefill pages (every prefill rank uses the same ids: ranks agree on pages)
    dst: list[int]  # decode pages
    chunks: tuple[int, ...]  # pages per chunk


# Pages move whole: a prompt that ends mid-page sends its last page like any other (its tail is
# whatever the prefill's pool holds there), so the check covers every slot of every page.
ROOMS = (
    RoomSpec(101, [3, 4, 7, 9, 10], [2, 3, 4, 12, 13], (2, 3)),
    RoomSpec(102, [11, 12, 13], [6, 8, 9], (1, 1, 1)),
)


def equal_tp_descriptors(spec: RoomSpec) -> int:
    """What one room costs one decode rank at equal TP: page runs x buffers per chunk, + the aux row."""
    runs, at = 0, 0
    for n in spec.chunks:
        runs += len(merge_runs(spec.src[at:at + n], spec.dst[at:at + n])[0])
        at += n
    return runs * BUFFERS + 1


def run_rooms(g: Group, specs: tuple[RoomSpec, ...]) -> dict[int, list[AuxRecord]]:
    """Both rooms at once, chunks interleaved; returns each decode rank's aux rows per room."""
    senders = {s.room: [r.mgr.create_sender(s.room) for r in g.prefills] for s in specs}  # type: ignore[union-attr]
    recvs = {s.room: [r.mgr.create_receiver(s.room, g.url) for r in g.decodes] for s in specs}  # type: ignore[union-attr]
    slots = {s.room: [r.aux.alloc() for r in g.decodes] for s in specs}
    for s in specs:
        wait_all(recvs[s.room], KVPoll.WaitingForInput)
        for recv, slot in zip(recvs[s.room], slots[s.room]):
            recv.init(s.dst, slot)
    for s in specs:
        wait_all(senders[s.room], KVPoll.WaitingForInput)
    cursor = {s.room: 0 for s in specs}
    for i in range(max(len(s.chunks) for s in specs)):
        for s in specs:
            if i >= len(s.chunks):
                continue
            pages = s.src[cursor[s.room]: cursor[s.room] + s.chunks[i]]
            cursor[s.room] += s.chunks[i]
            last = i == len(s.chunks) - 1
            for sender in senders[s.room]:
                sender.send(pages, last_chunk=last, aux=AuxRecord(room=0, token_id=s.room + 7, cached_tokens=3) if last else None)
    for s in specs:
        wait_all(senders[s.room], KVPoll.Success)
        wait_all(recvs[s.room], KVPoll.Success)
    rows = {s.room: [r.aux.read(slot) for r, slot in zip(g.decodes, slots[s.room])] for s in specs}
    for s in specs:
        for r, slot in zip(g.decodes, slots[s.room]):
            r.aux.free(slot)
    return rows


def expected_decode_pool(g: Group, d: Rank, total: int, specs: tuple[RoomSpec, ...]) -> list[torch.Tensor]:
    heads = torch.arange(d.first_head, d.first_head + d.pool.layout.num_kv_heads)
    out = []
    for b in range(BUFFERS):
        want = torch.zeros(PAGES, PAGE, len(heads), DIM)
        for s in specs:
            for sp, dp in zip(s.src, s.dst):
                want[dp] = code(b, torch.tensor(sp), torch.arange(PAGE)[:, None, None], heads[None, :, None], total)
        out.append(want.view(PAGES * PAGE, len(heads), DIM))
    return out


PAIRS = [  # (prefill TP, decode TP, KV heads, backends)
    (1, 1, 4, ("loopback",)),
    (2, 2, 4, ("loopback",)),
    (2, 1, 4, ("loopback", "mooncake")),  # decode scatters
    (1, 2, 4, ("loopback", "mooncake")),  # prefill gathers
    (1, 4, 4, ("loopback",)),
    (1, 4, 2, ("loopback",)),  # decode replicates its heads (Td > KV heads)
    (4, 2, 2, ("loopback",)),  # prefill replicas, two of them unused: told so, they end too
]


@pytest.mark.parametrize("tp_p,tp_d,total,backend",
                         [(p, d, h, b) for p, d, h, bs in PAIRS for b in bs],
                         ids=lambda v: str(v))
def test_decode_pools_hold_exactly_their_heads(groups: list[Group], server: BootstrapServer, tp_p: int, tp_d: int,
                                               total: int, backend: str) -> None:
    g = start(groups, server.url, backend, tp_p, tp_d, total)
    rows = run_rooms(g, ROOMS)
    for d in g.decodes:
        for got, want in zip(d.pool.buffers(), expected_decode_pool(g, d, total, ROOMS)):
            assert torch.equal(got, want), f"decode rank of {tp_p}->{tp_d}: pool differs"
    for s in ROOMS:
        assert [(a.room, a.token_id, a.cached_tokens) for a in rows[s.room]] == [(s.room, s.room + 7, 3)] * tp_d
    # nothing held on any rank, no staging page taken, nothing orphaned or tombstoned
    for r in g.prefills:
        t = r.mgr.tables()  # type: ignore[union-attr]
        assert (t["rooms"], t["orphans"], t["tombstones"], r.mgr.num_rooms()) == ([], [], [], 0)
    for r in g.decodes:
        assert (r.mgr.num_rooms(), r.mgr.num_fenced(), r.mgr.staging_pages_in_use()) == (0, 0, 0)  # type: ignore[union-attr]
    # cost: descriptors per room and decode rank, against what equal TP costs the same room
    stats = [r.mgr.transfer_stats() for r in g.prefills]  # type: ignore[union-attr]
    per_room_rank = sum(s["descriptors"] for s in stats) / (len(ROOMS) * tp_d)
    equal = sum(equal_tp_descriptors(s) for s in ROOMS) / len(ROOMS)
    kv_bytes = sum(len(s.src) for s in ROOMS) * total * PAGE * DIM * 4 * BUFFERS
    print(f"\n{tp_p}->{tp_d} H={total} {backend}: {per_room_rank:.1f} descriptors per room per decode rank "
          f"(equal TP {equal:.1f}), {sum(s['bytes'] for s in stats)} bytes for {kv_bytes} bytes of KV "
          f"(+ aux rows), prefill staging peak {max(s['staging_peak_bytes'] for s in stats)} bytes")
    assert per_room_rank <= 2 * equal
    if tp_p == tp_d:
        assert per_room_rank == equal and all(s["staging_peak_bytes"] == 0 for s in stats)  # zero-copy
    if backend == "loopback":
        # each decode rank's aux row was written once per room, whole, by its designated prefill rank
        tp = plan(tp_p, tp_d, total)
        for i, d in enumerate(g.decodes):
            aux_ptr, aux_end = d.aux.rows.data_ptr(), d.aux.rows.data_ptr() + d.aux.rows.numel()
            writers = [(p, n) for p, r in enumerate(g.prefills) for peer, dst, n in r.engine.log  # type: ignore[attr-defined]
                       if peer == d.engine.session_id and aux_ptr <= dst < aux_end]
            assert writers == [(tp.aux_rank(i), d.aux.row_nbytes)] * len(ROOMS)


def refusal(groups: list[Group], url: str, field: str, **kw: object) -> None:
    """Every rank of both sides gets the room; the decode fails it at lookup naming ``field`` in
    under a second, every prefill rank's sender fails too, and both sides end idle."""
    g = start(groups, url, "loopback", **kw)  # type: ignore[arg-type]
    senders = [r.mgr.create_sender(55) for r in g.prefills]  # type: ignore[union-attr]
    t0 = time.monotonic()
    recvs = [r.mgr.create_receiver(55, url) for r in g.decodes]  # type: ignore[union-attr]
    for recv in recvs:
        while recv.poll() is not KVPoll.Failed:
            assert time.monotonic() - t0 < 1.0, f"decode still {recv.poll().name}"
            time.sleep(0.005)
        reason = recv.failure_reason or ""
        assert "decode cannot receive this prefill's KV cache" in reason and field in reason, reason
    for sender in senders:
        while sender.poll() is not KVPoll.Failed:
            assert time.monotonic() - t0 < 1.0, f"prefill sender still {sender.poll().name}"
            time.sleep(0.005)
    assert all(r.mgr.num_rooms() == 0 for r in [*g.prefills, *g.decodes])
    assert all(r.mgr.staging_pages_in_use() == 0 for r in g.decodes)  # type: ignore[union-attr]


CONV = StateLayout(num_layers=1, shape=(8, 3), dtype="float32")


@pytest.mark.parametrize("field,kw", [
    ("tp_size: prefill 2 and decode 3 do not divide", dict(tp_p=2, tp_d=3, total=6)),
    ("total_kv_heads: prefill 4, decode 8", dict(tp_p=2, tp_d=1, total=4, decode_total=8)),
    ("page_size", dict(tp_p=2, tp_d=1, total=4, decode={"page_size": 8})),
    ("kv_dtype", dict(tp_p=1, tp_d=2, total=4, decode={"dtype": "float16"})),
    ("head_dim", dict(tp_p=1, tp_d=2, total=4, decode={"head_dim": 8})),
    ("state_shapes: per-rank recurrent state cannot be resharded", dict(tp_p=2, tp_d=1, total=4, state=CONV)),
    ("kv_staging", dict(tp_p=2, tp_d=1, total=4, decode_staging=0)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_unservable_pairs_fail_at_lookup_naming_the_field(groups: list[Group], server: BootstrapServer, field: str,
                                                          kw: dict) -> None:
    refusal(groups, server.url, field, **kw)
