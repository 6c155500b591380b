"""PrefillScheduler under random interleavings of arrivals, handshakes, transfer results,
failures, aborts and writes in flight: every request is answered once and every page released
once (hypothesis; harness of test_prefill_scheduler).
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.ipc.protocol import AbortReq
from tests.unit.test_prefill_scheduler import Node, gen, prompt
from transfer.poll import KVPoll


# ---- random interleavings -----------------------------------------------------------------------

EVENT = st.one_of(
    st.tuples(st.just("new"), st.integers(1, 40), st.integers(0, 3)),  # length, prefix family
    st.tuples(st.just("ready"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("success"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("fail"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("writing"), st.integers(0, 30), st.integers(0, 1)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(events=st.lists(EVENT, max_size=40), page_size=st.sampled_from([1, 4]), chunk=st.sampled_from([None, 3, 8]),
       ahead=st.sampled_from([0, 6, 24]))
def test_any_interleaving_releases_everything_exactly_once(events: list, page_size: int, chunk: int | None,
                                                           ahead: int) -> None:
    node = Node(page_size=page_size, pages=24, rows=4, chunk=chunk, max_tokens=16, ahead_pages=ahead)
    rooms: list[int] = []  # accepted rooms
    sent = 0
    for kind, a, b in events:
        if kind == "new":
            room, sent = sent, sent + 1
            node.step(gen(f"r{room}", prompt(a, base=b * 37)[:a], room=room))
            reply = node.replies.get(f"r{room}")
            if reply is None:
                rooms.append(room)
            else:  # longer than the whole pool: refused at once, its room aborted
                assert reply.http_status == 400 and a > 24 and node.sender(room).aborts
        elif rooms:
            room = rooms[a % len(rooms)]
            s = node.sender(room)
            if kind == "ready" and s.state is KVPoll.Bootstrapping:
                s.state = KVPoll.WaitingForInput
            elif kind == "success" and s.state is KVPoll.Transferring and s.sent and s.sent[-1][1]:
                s.state = KVPoll.Success
            elif kind == "fail" and not s.state.terminal:
                s.fail("injected")
            elif kind == "abort":
                node.step(AbortReq(rid=f"r{room}"))
            elif kind == "writing":
                s.writing = bool(b)
        if kind == "step":
            node.step()
    # Drain: every room finishes one way or another.
    for s in node.senders.by_room.values():
        s.writing = False
        if s.state is KVPoll.Bootstrapping:
            s.state = KVPoll.WaitingForInput
    for _ in range(200):
        if not node.sched.queues.reqs:
            break
        for s in node.senders.by_room.values():
            if s.state is KVPoll.Transferring and s.sent and s.sent[-1][1]:
                s.state = KVPoll.Success
        node.step()
    node.assert_idle()
    assert set(node.replies) == {f"r{r}" for r in range(sent)}
    for s in node.senders.by_room.values():
        if s.state is KVPoll.Success:
            assert s.sent and s.sent[-1][1] and len(s.pages) == len(set(s.pages))
