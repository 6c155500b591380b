"""PrefillScheduler when its collaborators raise: an exception in one request's handling fails that
request alone; every request is still answered and released exactly once, the queues stay
consistent (``check_integrity`` after every step), and later requests keep being served."""
from __future__ import annotations

import pytest

from common.ipc.protocol import AbortReq
from tests.unit.test_prefill_scheduler import Node, StubSender, _release_blocker, _to_stage, gen, prompt
from transfer.poll import KVPoll


class Boom(RuntimeError):
    pass


def raising_abort(s: StubSender, times: int = 1) -> None:
    """Like the transfer layer's abort when its notification raised: the room is failed, then it raises."""
    orig = s.abort
    left = [times]

    def abort(reason: str = "aborted by prefill") -> None:
        orig(reason)
        if left[0] > 0:
            left[0] -= 1
            raise Boom("Invalid argument (addr='tcp://decode-host-without-port')")
    s.abort = abort  # type: ignore[method-assign]


def run_until_idle(node: Node, steps: int = 20) -> None:
    for _ in range(steps):
        if not node.sched.queues.reqs:
            break
        node.step()
    node.assert_idle()


@pytest.mark.parametrize("stage", ["bootstrap", "waiting", "chunked", "inflight"])
def test_abort_that_raises_still_answers_and_releases_the_request(stage: str) -> None:
    node = Node(page_size=4, chunk=4 if stage == "chunked" else None)
    _to_stage(node, stage)
    raising_abort(node.sender(1))
    node.step(AbortReq(rid="a"))  # does not raise
    _release_blocker(node)
    run_until_idle(node)
    reply = node.replies["a"]
    assert reply.finish is not None and reply.finish.type == "abort" and reply.http_status is None


def test_fail_all_with_raising_aborts_does_not_raise_and_answers_everyone() -> None:
    node = Node(page_size=4)
    node.step(gen("a", prompt(6), room=1), gen("b", prompt(6, base=9), room=2))
    node.ready(1)
    node.step()  # a in flight, b bootstrapping
    for room in (1, 2):
        raising_abort(node.sender(room), times=5)
    out = node.sched.fail_all("internal error")
    assert out == []  # answered once their rooms are terminal (already: abort failed them)
    node.sched.check_integrity()
    run_until_idle(node)
    assert {rid: o.http_status for rid, o in node.replies.items()} == {"a": 500, "b": 500}


def test_an_error_for_one_inflight_request_does_not_wedge_the_node() -> None:
    """A succeeds in the step in which B's timeout abort raises: A is answered, nothing is
    finished twice, and later requests still run their forwards."""
    node = Node(timeout_s=1.0)
    node.step(gen("A", prompt(5), room=1), gen("B", prompt(4, base=30), room=2))
    node.ready(1, 2)
    node.step()
    raising_abort(node.sender(2))
    node.sender(1).state = KVPoll.Success
    node.now = 2.0
    out = node.step()
    assert [o.rid for o in out] == ["A"] and out[0].error is None
    forwards = node.sched.counters.forwards
    node.step(gen("C", prompt(3, base=60), room=3))
    node.ready(3)
    node.step()
    assert node.sched.counters.forwards == forwards + 1, "the node still computes"
    node.sender(3).state = KVPoll.Success
    run_until_idle(node)
    assert node.replies["B"].http_status == 500 and node.replies["C"].error is None


def test_a_poll_that_keeps_raising_fails_that_request_alone_then_gives_it_up() -> None:
    node = Node(timeout_s=2.0)
    node.step(gen("a", prompt(5), room=1), gen("b", prompt(5, base=20), room=2))
    node.ready(1, 2)
    node.step()
    s = node.sender(1)

    def broken_poll() -> KVPoll:
        raise Boom("corrupt room state")
    s.poll = broken_poll  # type: ignore[method-assign]
    node.sender(2).state = KVPoll.Success
    (ok,) = node.step()
    assert ok.rid == "b" and ok.error is None
    assert s.aborts and "corrupt room state" in s.aborts[0]
    node.now = 1.0
    assert node.step() == [], "held while its transfer may still read the pages"
    node.now = 3.5
    (gone,) = node.step()
    assert gone.rid == "a" and gone.http_status == 500 and "corrupt room state" in (gone.error or "")
    node.assert_idle()


def test_a_request_that_raises_on_arrival_fails_alone() -> None:
    node = Node()
    real = node.senders

    def senders(room: int, prompt_digest: str = "") -> StubSender:
        if room == 2:
            raise Boom("unexpected")  # not a TransferError: a bug in the transfer layer
        return real(room)
    node.sched.senders = senders
    out = node.step(gen("a", prompt(5), room=1), gen("b", prompt(5), room=2), gen("c", prompt(5, base=7), room=3))
    assert [(o.rid, o.http_status) for o in out] == [("b", 500)]
    node.ready(1, 3)
    node.step()
    node.sender(1).state = node.sender(3).state = KVPoll.Success
    run_until_idle(node)
    assert node.replies["a"].error is None and node.replies["c"].error is None


def test_send_error_other_than_transfer_error_fails_only_that_request() -> None:
    node = Node()
    node.step(gen("a", prompt(5), room=1), gen("b", prompt(5, base=7), room=2))
    node.ready(1, 2)

    def bad_send(*args: object, **kw: object) -> None:
        raise ValueError("pages out of range")
    node.sender(1).send = bad_send  # type: ignore[method-assign]
    node.step()
    assert node.sender(1).aborts and not node.sender(2).aborts
    node.sender(2).state = KVPoll.Success
    run_until_idle(node)
    assert node.replies["a"].http_status == 500 and node.replies["b"].error is None


def test_replies_of_a_step_that_raised_are_handed_out_by_fail_all() -> None:
    """A reply made before an exception escaped the step is not lost: fail_all hands it out."""
    node = Node()
    node.step(gen("a", prompt(5), room=1), gen("b", prompt(5, base=9), room=2))
    node.ready(1)
    node.step()  # a in flight, b bootstrapping
    node.sender(1).state = KVPoll.Success

    def broken() -> list:
        raise Boom("schedule")
    node.sched._schedule = broken  # type: ignore[method-assign]
    with pytest.raises(Boom):
        node.sched.step([])  # a was answered and released before _schedule raised
    out = {o.rid: o for o in node.sched.fail_all("internal error")}
    assert out["a"].error is None and out["a"].finish is not None
    assert "b" not in out  # failed, answered once its room is terminal
    del node.sched._schedule  # type: ignore[attr-defined]
    for o in out.values():
        node.replies[o.rid] = o
    run_until_idle(node)
    assert node.replies["b"].http_status == 500
