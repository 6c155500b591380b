"""The decode's holding set (transfer.fenced) at the manager level, fake data plane: a room bound
to a prefill that stops answering fails after heartbeat bound + quarantine but stays fenced
(create_receiver refuses its id, ``fenced()`` is True) until the peer is proven unable to write,
and is released exactly once under each release condition."""
from __future__ import annotations

import time

import pytest

from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    Cluster,
    cluster,
    handshake,
    until_terminal,
    wait_for,
)
from transfer import messages as m
from transfer.config import KVManagerConfig
from transfer.decode import DecodeKVManager
from transfer.errors import TransferError
from transfer.poll import KVPoll

HOLD_CFG = KVManagerConfig(**{**CFG.__dict__, "waiting_timeout_s": 30.0})


def fenced_room(cluster: Cluster) -> tuple:
    """A prefill muted after the handshake (port still open): the decode fails room 1 and fences it."""
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode(cfg=HOLD_CFG)
    sender, recv = handshake(pm, dm, room=1, dst_pages=[1])
    real_send = pm._push.send
    pm._push.send = lambda endpoint, msg: True  # type: ignore[method-assign]  # hung: port open, no answer
    st, _ = until_terminal(recv, timeout=5)
    assert st is KVPoll.Failed and "heartbeat" in (recv.failure_reason or "")
    assert recv.fenced() and dm.num_fenced() == 1
    return pm, dm, sender, recv, real_send


def count_releases(dm: DecodeKVManager) -> list[int]:
    released: list[int] = []
    real = dm._fenced.release

    def counting(room: int, why: str) -> bool:
        ok = real(room, why)
        if ok:
            released.append(room)
        return ok

    dm._fenced.release = counting  # type: ignore[method-assign]
    return released


def test_fenced_room_id_is_not_reusable_and_stays_held_while_the_peer_is_silent(cluster: Cluster) -> None:
    pm, dm, _, recv, _ = fenced_room(cluster)
    with pytest.raises(TransferError, match="fenced"):
        dm.create_receiver(1, ADDR)
    time.sleep(HOLD_CFG.heartbeat_bound_s + HOLD_CFG.hung_peer_quarantine_s)  # no timer lifts a fence
    assert recv.fenced() and dm.num_fenced() == 1 and recv.poll() is KVPoll.Failed


def test_peer_that_answers_again_is_asked_to_abort_and_its_answer_releases_once(cluster: Cluster) -> None:
    pm, dm, sender, recv, real_send = fenced_room(cluster)
    released = count_releases(dm)
    pm._push.send = real_send  # type: ignore[method-assign]  # resumed: Pong -> AbortRoom -> fenced Failed
    wait_for(lambda: not recv.fenced(), timeout=5)
    assert until_terminal(sender)[0] is KVPoll.Failed and "aborted by decode" in (sender.failure_reason or "")
    # A late duplicate answer (a second status for the same room) releases nothing again.
    dm._on_status(m.TransferStatus(room=1, status=int(KVPoll.Failed), prefill_rank=0))
    dm._on_status(m.TransferStatus(room=1, status=int(KVPoll.Success), prefill_rank=0))
    assert released == [1] and dm.num_fenced() == 0
    # The peer serves again (room ids are unique per request; duplicate AbortRooms for room 1,
    # one per Pong while it was held, are answered from the prefill's tombstone).
    s2, r2 = handshake(pm, dm, room=2, dst_pages=[2])
    s2.send([1], last_chunk=True)
    assert until_terminal(r2)[0] is KVPoll.Success and not r2.fenced()


def test_a_status_for_the_room_releases_it(cluster: Cluster) -> None:
    _, dm, _, recv, _ = fenced_room(cluster)
    released = count_releases(dm)
    dm._on_status(m.TransferStatus(room=1, status=int(KVPoll.Success), prefill_rank=0))
    assert not recv.fenced() and released == [1]


def test_refused_control_port_releases_the_room(cluster: Cluster) -> None:
    pm, dm, _, recv, _ = fenced_room(cluster)
    released = count_releases(dm)
    pm.close()  # the process is gone: its control port refuses connections
    wait_for(lambda: not recv.fenced(), timeout=3)
    time.sleep(3 * HOLD_CFG.heartbeat_interval_s)  # further probes find nothing to release
    assert released == [1] and dm.num_fenced() == 0
    assert pm.endpoint not in dm._push._socks  # the socket opened only to probe it is gone


def test_a_new_instance_on_the_endpoint_releases_the_room_the_same_one_does_not(cluster: Cluster) -> None:
    pm, dm, _, recv, _ = fenced_room(cluster)
    released = count_releases(dm)
    dm._liveness.on_pong(m.Pong(seq=0, endpoint=pm.endpoint, instance_id=pm.instance_id))  # same process: proves nothing
    assert recv.fenced()
    dm._liveness.on_pong(m.Pong(seq=0, endpoint=pm.endpoint, instance_id="a-restarted-process"))
    dm._liveness.on_pong(m.Pong(seq=0, endpoint=pm.endpoint, instance_id="a-restarted-process"))
    assert not recv.fenced() and released == [1]


def test_close_with_a_fenced_room_stops_every_thread(cluster: Cluster) -> None:
    _, dm, _, recv, _ = fenced_room(cluster)
    dm.close()  # the fixture then checks that no pdc- thread outlives the managers
    assert recv.fenced()  # closing proves nothing about the peer


def test_a_peer_that_never_answers_holds_pages_no_longer_than_the_bound(cluster: Cluster) -> None:
    """PDC_MAX_FENCE_S: a hung prefill (port open, never answering) cannot keep a decode's pages
    fenced for good; after the bound the room is released once and its id is usable again."""
    pm, _ = cluster.prefill()
    bounded = KVManagerConfig(**{**HOLD_CFG.__dict__, "max_fence_s": 0.5})
    dm, _ = cluster.decode(cfg=bounded)
    sender, recv = handshake(pm, dm, room=9, dst_pages=[1])
    pm._push.send = lambda endpoint, msg: True  # type: ignore[method-assign]  # hung: port open, no answer
    assert until_terminal(recv, timeout=5)[0] is KVPoll.Failed and recv.fenced()
    t0 = time.monotonic()
    wait_for(lambda: not recv.fenced(), timeout=5)
    assert time.monotonic() - t0 < 0.5 + 2 * bounded.heartbeat_interval_s + 1.0
    assert dm.num_fenced() == 0 and recv.poll() is KVPoll.Failed
    dm.create_receiver(9, ADDR).abort("reused after the bound")  # the id is free again
