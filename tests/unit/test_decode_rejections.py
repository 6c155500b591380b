"""Decode scheduler: pages that are only temporarily unavailable never fail a request, and a
request refused on arrival tells its prefill at once (fake engine and transfer, as in
test_decode_scheduler)."""
from __future__ import annotations

from tests.unit.test_decode_scheduler import Rig, prompt_of, reference
from transfer.poll import KVPoll


def test_pages_held_by_a_draining_room_are_waited_for_not_reported_as_oom() -> None:
    """a needs pages that b, aborted while its TransferInfo was out, holds until the prefill
    answers: a waits for them instead of failing with a false out-of-memory 500."""
    rig = Rig(pages=8, reserved=1, ratio_init=0.0)  # 32 tokens of KV
    rig.add("a", prompt_of(1, 8), 20, room=1)  # 28 tokens at most: 7 pages
    rig.add("b", prompt_of(2, 8), 2, room=2)  # 2 pages
    rig.step(complete=False)
    assert {r.rid for r in rig.sched.queues.transfer} == {"a", "b"}
    rig.hub.complete(1)
    rig.abort("b")  # its pages wait in draining: the prefill may still write them
    for _ in range(40):
        rig.step(complete=False)
    assert not rig.finished("a"), "a must wait for b's pages, not fail"
    assert rig.sched.queues.draining
    rig.hub.rx[2].status = KVPoll.Failed  # the prefill answers b's abort: its pages come back
    rig.run()
    fin = rig.final("a")
    assert fin.http_status is None and rig.tokens("a") == reference(prompt_of(1, 8), 20)
    rig.assert_clean()


def test_requests_refused_without_a_receiver_tell_their_prefill() -> None:
    rig = Rig(pages=8)
    rig.add("a", prompt_of(1, 5), 3, room=1)
    rig.add("a", prompt_of(2, 5), 3, room=5)  # duplicate rid, its own room
    rig.add("big", list(range(40)), 3, room=2)  # bigger than the pool
    rig.step(complete=False)
    (dup,) = rig.outputs.pop("a")  # the live "a" is not streaming: this is the duplicate's answer
    assert dup.http_status == 400
    refused = {room: (addr, reason) for room, addr, reason in rig.hub.rejected}
    assert set(refused) == {5, 2}, "each refused room is reported to its prefill"
    assert refused[5][0] == "127.0.0.1:8998" and "already running" in refused[5][1]
    assert "does not fit" in refused[2][1]
    assert 5 not in rig.hub.rx and 2 not in rig.hub.rx, "no receiver was created for them"
    rig.run()
    assert rig.tokens("a") == reference(prompt_of(1, 5), 3)
    rig.assert_clean()


def test_a_room_already_in_flight_here_is_not_reported_as_refused() -> None:
    rig = Rig()
    rig.add("a", prompt_of(1, 5), 3, room=1)
    rig.add("b", prompt_of(2, 5), 3, room=1)  # same room: the receiver factory refuses it
    rig.step()
    assert rig.final("b").http_status == 409 and rig.hub.rejected == []
    rig.run()
    rig.assert_clean()


def test_an_abort_that_raises_still_answers_and_frees_the_room_once() -> None:
    rig = Rig()
    rig.add("x", prompt_of(1, 9), 5, room=1)
    rig.step(complete=False)
    rx = rig.hub.rx[1]
    assert rx.status is KVPoll.Transferring

    def abort(reason: str = "") -> None:
        rx.abort_pending = reason
        raise RuntimeError("could not queue AbortRoom")
    rx.abort = abort  # type: ignore[method-assign]
    rig.abort("x")  # does not raise
    rig.step(complete=False)
    assert rig.final("x").finish.type == "abort"  # type: ignore[union-attr]
    assert rig.sched.queues.draining, "pages stay held until the prefill answers"
    rx.status = KVPoll.Failed
    rig.run()
    rig.assert_clean()
