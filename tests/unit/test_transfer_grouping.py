"""A prefill transfer worker writes every chunk queued behind a running write in one engine call.

Two real Mooncake engines in this process (TCP on loopback) move the bytes; the prefill's engine
holds its first write at a gate so the next chunks queue up deterministically. Checked: one call
for the group, every room's pages and its own aux row land (each last chunk has its own staging
row), a room failed while queued is left out of the call and its pages are not touched, and a
failed group write fails every room in it.
"""
from __future__ import annotations

import threading

import pytest
import torch

from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    LAYOUT,
    Cluster,
    Side,
    cluster,
    handshake,
    make_side,
    until_terminal,

)
from transfer.aux import AuxRecord
from transfer.backends.fake import FakeDataPlane
from transfer.descriptors import Descriptors
from transfer.poll import KVPoll

mooncake = pytest.importorskip("transfer.backends.mooncake")
pytest.importorskip("mooncake.engine")

ROOMS = [2, 4, 6, 8]  # all on worker 0 (room % 2): one queue
SRC_PAGES = {2: [1, 2], 4: [3, 4], 6: [5, 6], 8: [7, 8]}
DST_PAGES = {2: [9, 10], 4: [11, 12], 6: [13, 14], 8: [15, 1]}


def _descriptors(room: int) -> int:
    """K/V runs of the room's pages in every buffer, plus its aux row."""
    src, dst = SRC_PAGES[room], DST_PAGES[room]
    runs = 1 + sum(1 for i in range(1, len(src)) if (src[i] - src[i - 1], dst[i] - dst[i - 1]) != (1, 1))
    return 2 * LAYOUT.num_layers * runs + 1


class GatedMooncake(mooncake.MooncakeDataPlane):
    """The first write waits for ``gate``; every write's descriptor count is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.in_first = threading.Event()
        self.calls: list[int] = []

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        if not self.calls:
            self.calls.append(len(desc))
            self.in_first.set()
            assert self.gate.wait(10)
        else:
            self.calls.append(len(desc))
        return super().write(peer_session, desc)


def _mooncake_side(engine: mooncake.MooncakeDataPlane) -> Side:
    side = make_side()
    side.engine = engine  # type: ignore[assignment]
    return side


def _fill(side: Side) -> None:
    """Every page of every buffer gets distinct values, so a misplaced page cannot pass."""
    for i, buf in enumerate(side.pool.buffers()):
        buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).reshape(buf.shape) + 1000 * (i + 1))


def _pages(side: Side, pages: list[int]) -> list[torch.Tensor]:
    ps = LAYOUT.page_size
    return [torch.cat([buf[p * ps:(p + 1) * ps] for p in pages]) for buf in side.pool.buffers()]


def _group(cluster: Cluster, engine: FakeDataPlane | mooncake.MooncakeDataPlane):
    """Handshake every room (aux slot = its index), send the first, wait until its write runs."""
    pm, p_side = cluster.prefill(_mooncake_side(engine))
    dm, d_side = cluster.decode(_mooncake_side(mooncake.MooncakeDataPlane()))
    _fill(p_side)
    pairs = {room: handshake(pm, dm, room=room, dst_pages=DST_PAGES[room], aux_slot=i) for i, room in enumerate(ROOMS)}
    return pm, p_side, d_side, pairs


def _send(pairs: dict, room: int) -> None:
    pairs[room][0].send(SRC_PAGES[room], last_chunk=True, aux=AuxRecord(room=room, token_id=100 + room, cached_tokens=0))


def test_chunks_queued_behind_a_write_go_in_one_call_with_their_own_aux_rows(cluster: Cluster) -> None:
    engine = GatedMooncake()
    _, p_side, d_side, pairs = _group(cluster, engine)
    _send(pairs, ROOMS[0])
    assert engine.in_first.wait(5)
    for room in ROOMS[1:]:
        _send(pairs, room)
    engine.gate.set()
    for room in ROOMS:
        sender, recv = pairs[room]
        assert until_terminal(recv)[0] is KVPoll.Success, recv.failure_reason
        assert until_terminal(sender)[0] is KVPoll.Success
    assert len(engine.calls) == 2, f"engine calls {engine.calls}: the queued chunks were not grouped"
    assert engine.calls == [_descriptors(ROOMS[0]), sum(_descriptors(r) for r in ROOMS[1:])]
    for i, room in enumerate(ROOMS):
        for got, want in zip(_pages(d_side, DST_PAGES[room]), _pages(p_side, SRC_PAGES[room])):
            assert torch.equal(got, want), f"room {room}: pages differ"
        rec = d_side.aux.read(i)
        assert (rec.room, rec.token_id) == (room, 100 + room), f"aux slot {i} holds {rec}"


def test_a_room_failed_while_queued_is_left_out_of_the_group_write(cluster: Cluster) -> None:
    engine = GatedMooncake()
    _, p_side, d_side, pairs = _group(cluster, engine)
    _send(pairs, ROOMS[0])
    assert engine.in_first.wait(5)
    for room in ROOMS[1:]:
        _send(pairs, room)
    victim = ROOMS[2]
    pairs[victim][0].abort("aborted while queued")
    engine.gate.set()
    assert until_terminal(pairs[victim][0])[0] is KVPoll.Failed
    assert until_terminal(pairs[victim][1])[0] is KVPoll.Failed
    for got in _pages(d_side, DST_PAGES[victim]):
        assert not got.any(), "a failed room's pages were written"
    for room in (r for r in ROOMS if r != victim):
        assert until_terminal(pairs[room][1])[0] is KVPoll.Success
        for got, want in zip(_pages(d_side, DST_PAGES[room]), _pages(p_side, SRC_PAGES[room])):
            assert torch.equal(got, want)
    assert engine.calls == [_descriptors(ROOMS[0]), sum(_descriptors(r) for r in ROOMS[1:] if r != victim)]


class GatedFake(FakeDataPlane):
    """The first write waits for ``gate`` and succeeds; every later one fails (decode unreachable)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.in_first, self.calls = threading.Event(), threading.Event(), 0

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.in_first.set()
            assert self.gate.wait(10)
            return super().write(peer_session, desc)
        return False


def test_a_failed_group_write_fails_every_room_in_it(cluster: Cluster) -> None:
    engine = GatedFake()
    side = make_side()
    side.engine = engine
    pm, _ = cluster.prefill(side)
    dm, _ = cluster.decode()
    pairs = {room: handshake(pm, dm, room=room, dst_pages=DST_PAGES[room], aux_slot=i) for i, room in enumerate(ROOMS)}
    _send(pairs, ROOMS[0])
    assert engine.in_first.wait(5)
    for room in ROOMS[1:]:
        _send(pairs, room)
    engine.gate.set()
    assert until_terminal(pairs[ROOMS[0]][1])[0] is KVPoll.Success
    for room in ROOMS[1:]:
        assert until_terminal(pairs[room][0])[0] is KVPoll.Failed
        assert "unreachable" in (pairs[room][0].failure_reason or "")
        assert until_terminal(pairs[room][1])[0] is KVPoll.Failed
    assert engine.calls == 2, "the queued rooms were not written in one call"
