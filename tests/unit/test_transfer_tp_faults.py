"""Failures across TP ranks, one manager per rank, fake data plane, in-memory registry: a room that
several prefill ranks write fails on the decode only once every source answered (or is proven
gone), every rank of both sides reaches a terminal state, and the decode's staging pages come
back exactly when its pages may be reused (a fenced room keeps them until the fence lifts)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from bootstrap_server.heads import rank_heads
from common.kvcache.pool import KVLayout, KVPool
from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    Cluster,
    cluster,
    until_terminal,
    wait_for,
)
from transfer.aux import AuxPool, AuxRecord
from transfer.backends.fake import FakeDataPlane
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.factory import node_kv_args
from transfer.handles import DecodeKVReceiver, PrefillKVSender
from transfer.poll import KVPoll
from transfer.prefill import PrefillKVManager
from transfer.staging import StagingArea

HOLD_CFG = KVManagerConfig(**{**CFG.__dict__, "waiting_timeout_s": 30.0})
PAGES = 16


def side(tp: int, rank: int, total: int, staging: int = PAGES) -> tuple:
    lay = KVLayout(num_layers=2, num_kv_heads=rank_heads(tp, total, rank).count, head_dim=4, page_size=4, dtype="float32")
    pool, aux = KVPool(lay, PAGES, "cpu"), AuxPool(4, top_k=2)
    return node_kv_args(pool, None, aux, "127.0.0.1", tp_rank=rank, tp_size=tp, total_kv_heads=total,
                        staging_pages=staging), aux


@dataclass
class TP:
    prefills: list[PrefillKVManager]
    decodes: list[DecodeKVManager]


def tp_group(cluster: Cluster, tp_p: int, tp_d: int, total: int, cfg: KVManagerConfig = CFG,
             decode_staging: int = PAGES) -> TP:
    prefills, decodes = [], []
    for p in range(tp_p):
        args, _ = side(tp_p, p, total)
        prefills.append(PrefillKVManager(args, FakeDataPlane(), cluster.boot, ADDR, cfg))
        cluster.managers.append(prefills[-1])
    for d in range(tp_d):
        args, _ = side(tp_d, d, total, decode_staging)
        decodes.append(DecodeKVManager(args, FakeDataPlane(), cluster.boot, cfg))
        cluster.managers.append(decodes[-1])
    return TP(prefills, decodes)


def handshake(g: TP, room: int, pages: list[int]) -> tuple[list[PrefillKVSender], list[DecodeKVReceiver]]:
    senders = [pm.create_sender(room) for pm in g.prefills]
    recvs = [dm.create_receiver(room, ADDR) for dm in g.decodes]
    for recv in recvs:
        wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
        recv.init(pages, 0)
    for sender in senders:
        wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    return senders, recvs


def idle(g: TP) -> None:
    for pm in g.prefills:
        wait_for(lambda: pm.num_rooms() == 0)
    for dm in g.decodes:
        wait_for(lambda: dm.num_rooms() == 0 and dm.num_fenced() == 0 and dm.staging_pages_in_use() == 0)


@pytest.mark.parametrize("tp_p,tp_d,total", [(2, 1, 4), (4, 2, 2), (1, 2, 4)])
def test_decode_abort_reaches_every_prefill_rank_and_the_unused_replicas(cluster: Cluster, tp_p: int, tp_d: int,
                                                                          total: int) -> None:
    g = tp_group(cluster, tp_p, tp_d, total)
    senders, recvs = handshake(g, 7, [1, 2, 3])
    senders[0].send([4], last_chunk=False)
    for recv in recvs:  # the node aborts the request on each of its ranks
        recv.abort("client went away")
    # every rank of both sides ends at once (well inside the 1 s waiting timeout that would
    # otherwise end a forgotten room), the replicas that had nothing to send included
    for handle in [*recvs, *senders]:
        st, took = until_terminal(handle)
        assert st is KVPoll.Failed and took < 0.5
    idle(g)


def test_one_failing_source_fails_the_room_after_the_other_source_answered(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4)
    senders, (recv,) = handshake(g, 8, [5, 6])
    senders[0].send([1, 2], last_chunk=True, aux=AuxRecord(room=0, token_id=1, cached_tokens=0))
    assert until_terminal(senders[0])[0] is KVPoll.Success  # rank 0 wrote its heads
    assert recv.poll() is KVPoll.Transferring  # half the heads are not a room
    senders[1].abort("prefill rank 1 gave up")
    st, _ = until_terminal(recv)
    assert st is KVPoll.Failed and "prefill rank 1" in (recv.failure_reason or "")
    assert until_terminal(senders[1])[0] is KVPoll.Failed
    idle(g)


def test_a_source_that_fails_first_gets_the_others_aborted(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4)
    senders, (recv,) = handshake(g, 9, [5, 6])
    senders[1].abort("prefill rank 1 gave up")
    assert until_terminal(senders[1])[0] is KVPoll.Failed
    # rank 0 is told by the decode (AbortRoom), and the decode fails once rank 0 answered
    assert until_terminal(senders[0])[0] is KVPoll.Failed
    assert "aborted by decode" in (senders[0].failure_reason or "")
    assert until_terminal(recv)[0] is KVPoll.Failed
    idle(g)


def test_hung_source_fences_the_room_and_its_staging_until_it_answers(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4, cfg=HOLD_CFG)
    senders, (recv,) = handshake(g, 10, [5, 6, 7])
    dm = g.decodes[0]
    assert dm.staging_pages_in_use() == 3  # 2 -> 1: the decode scatters, so the room holds staging
    hung = g.prefills[1]
    real_send = hung._push.send
    hung._push.send = lambda endpoint, msg: True  # type: ignore[method-assign]  # port open, no answer
    st, _ = until_terminal(recv, timeout=5)
    assert st is KVPoll.Failed and recv.fenced()
    assert until_terminal(senders[0])[0] is KVPoll.Failed  # the live rank was aborted
    assert dm.staging_pages_in_use() == 3  # a write of the hung rank may still land there
    hung._push.send = real_send  # type: ignore[method-assign]  # resumes: Pong -> AbortRoom -> Failed
    wait_for(lambda: not recv.fenced(), timeout=5)
    assert until_terminal(senders[1])[0] is KVPoll.Failed
    idle(g)


def test_killed_source_fails_the_room_within_the_heartbeat_bound_without_a_fence(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4, cfg=HOLD_CFG)
    senders, (recv,) = handshake(g, 12, [5, 6])
    dead = g.prefills[1]
    dead._push.send = lambda endpoint, msg: True  # type: ignore[method-assign]  # dies without a word
    dead.close()  # its control port now refuses connections, as after SIGKILL
    st, took = until_terminal(recv, timeout=5)
    assert st is KVPoll.Failed and not recv.fenced()
    assert took <= HOLD_CFG.heartbeat_bound_s + 1.0
    assert until_terminal(senders[0])[0] is KVPoll.Failed  # the live rank was aborted
    assert until_terminal(senders[1])[0] is KVPoll.Failed
    idle(g)


def test_abort_during_the_scatter_waits_for_the_copy(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4)
    dm = g.decodes[0]
    area = dm._staging
    assert area is not None
    copying, go = threading.Event(), threading.Event()
    real = area.scatter

    def slow(*a: object) -> None:
        copying.set()
        go.wait(10)
        real(*a)  # type: ignore[arg-type]

    area.scatter = slow  # type: ignore[method-assign]
    senders, (recv,) = handshake(g, 13, [5, 6])
    for sender in senders:
        sender.send([1, 2], last_chunk=True, aux=AuxRecord(room=0, token_id=1, cached_tokens=0))
    assert copying.wait(5)
    recv.abort("client went away")
    time.sleep(CFG.heartbeat_bound_s + CFG.hung_peer_quarantine_s + 0.3)  # past the abort's fence deadline
    # still copying into the room's pages: not terminal (the caller must not free them), staging held
    assert recv.poll() is KVPoll.Transferring and dm.staging_pages_in_use() == 2
    go.set()
    assert until_terminal(recv)[0] is KVPoll.Failed and "client went away" in (recv.failure_reason or "")
    for sender in senders:
        assert until_terminal(sender)[0] is KVPoll.Success
    idle(g)


def test_a_room_larger_than_the_free_staging_fails_at_init_and_tells_every_source(cluster: Cluster) -> None:
    g = tp_group(cluster, 2, 1, 4, decode_staging=2)
    senders = [pm.create_sender(14) for pm in g.prefills]
    recv = g.decodes[0].create_receiver(14, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([5, 6, 7], 0)  # 3 pages to scatter, 2 staging pages
    assert recv.poll() is KVPoll.Failed and "decode staging full: 3 pages wanted, 2 free" in (recv.failure_reason or "")
    for sender in senders:  # told at once, not at their bootstrap timeout
        st, took = until_terminal(sender)
        assert st is KVPoll.Failed and took < 0.5
    idle(g)


def unknown_total_group(cluster: Cluster, tp_p: int, tp_d: int) -> TP:
    """Ranks built the way a node that does not pass the model's KV head count builds them."""
    g = TP([], [])
    for tp, mgrs, make in ((tp_p, g.prefills, lambda a: PrefillKVManager(a, FakeDataPlane(), cluster.boot, ADDR, CFG)),
                           (tp_d, g.decodes, lambda a: DecodeKVManager(a, FakeDataPlane(), cluster.boot, CFG))):
        for r in range(tp):
            lay = KVLayout(num_layers=2, num_kv_heads=4 // tp, head_dim=4, page_size=4, dtype="float32")
            args = node_kv_args(KVPool(lay, PAGES, "cpu"), None, AuxPool(4, top_k=2), "127.0.0.1", r, tp,
                                staging_pages=PAGES)
            mgrs.append(make(args))
            cluster.managers.append(mgrs[-1])
    return g


def test_ranks_that_do_not_know_the_model_head_count_still_pair_at_equal_tp(cluster: Cluster) -> None:
    g = unknown_total_group(cluster, 2, 2)
    senders, recvs = handshake(g, 15, [5, 6])
    for sender in senders:
        sender.send([1, 2], last_chunk=True, aux=AuxRecord(room=0, token_id=1, cached_tokens=0))
    for handle in [*senders, *recvs]:
        assert until_terminal(handle)[0] is KVPoll.Success
    idle(g)


def test_ranks_that_do_not_know_the_model_head_count_refuse_other_tp_sizes_at_lookup(cluster: Cluster) -> None:
    g = unknown_total_group(cluster, 2, 1)
    recv = g.decodes[0].create_receiver(16, ADDR)
    st, took = until_terminal(recv)
    assert st is KVPoll.Failed and took < 1.0
    assert "total_kv_heads: the prefill did not register it" in (recv.failure_reason or "")
    idle(g)


def test_incomplete_prefill_layout_fails_at_lookup(cluster: Cluster) -> None:
    args, _ = side(2, 0, 4)
    pm = PrefillKVManager(args, FakeDataPlane(), cluster.boot, ADDR, CFG)  # rank 1 never registers
    cluster.managers.append(pm)
    dargs, _ = side(1, 0, 4)
    dm = DecodeKVManager(dargs, FakeDataPlane(), cluster.boot, CFG)
    cluster.managers.append(dm)
    recv = dm.create_receiver(11, ADDR)
    st, took = until_terminal(recv)
    assert st is KVPoll.Failed and "1 of 2 ranks registered" in (recv.failure_reason or "")
    assert took < 1.0 and dm.num_rooms() == 0


def test_staging_area_hands_out_every_page_once() -> None:
    area = StagingArea(10, page_nbytes=8, device="cpu")  # type: ignore[arg-type]
    a, b, c = area.alloc(4), area.alloc(3), area.alloc(3)
    assert (a, b, c) == ([(0, 4)], [(4, 3)], [(7, 3)]) and area.alloc(1) is None
    area.free(b)
    assert area.alloc(4) is None  # 3 free: nothing taken
    area.free(a)  # 0..6 free, merged
    assert area.alloc(5) == [(0, 5)]
    area.free(c)
    assert sorted(area.alloc(5)) == [(5, 5)] and area.free_pages() == 0
    with pytest.raises(ValueError, match="freed twice"):
        area.free([(5, 1), (5, 1)])


def test_staging_area_splits_a_room_over_extents_when_no_single_one_fits() -> None:
    area = StagingArea(6, page_nbytes=8, device="cpu")  # type: ignore[arg-type]
    x, y, z = area.alloc(2), area.alloc(2), area.alloc(2)
    area.free(x)
    area.free(z)
    assert area.alloc(4) == [(0, 2), (4, 2)]
    area.free(y)
    assert area.free_pages() == 2
