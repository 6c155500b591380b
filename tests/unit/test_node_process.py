"""The node skeleton both roles run (common/node): the loop around a scheduler, and what the
launcher ships to the spawned scheduler process. No model, no sockets."""
from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

from common.config import SchedulerConfig, TransferConfig
from common.ipc.protocol import AbortReq, ReqOutput, WorkItem
from common.node.process import BUSY_WAIT_S, IDLE_WAIT_S, serve
from decode_node.process import DecodePart
from decode_node.req import DecodeCounters
from decode_node.stats import DecodeStats
from prefill_node.process import PrefillPart


class Boom(RuntimeError):
    pass


class LoopIO:
    """NodeIO as the loop sees it: hands out scripted messages, records waits and sends."""

    def __init__(self, stop: threading.Event, inputs: list[list[WorkItem]]) -> None:
        self.stop, self.inputs = stop, inputs
        self.waits: list[float] = []
        self.sent: list[list[ReqOutput]] = []

    def recv(self, timeout_s: float = 0.0) -> list[WorkItem]:
        self.waits.append(timeout_s)
        msgs = self.inputs.pop(0) if self.inputs else []
        if not self.inputs:
            self.stop.set()
        return msgs

    def send(self, items: list[ReqOutput]) -> None:
        self.sent.append(list(items))


class Scripted:
    """A scheduler whose runnable/idle answers are scripted, one per turn; step echoes its input."""

    def __init__(self, runnable: list[bool], idle: list[bool]) -> None:
        self._runnable, self._idle = runnable, idle
        self.steps: list[list[WorkItem]] = []

    def runnable(self) -> bool:
        return self._runnable.pop(0)

    def idle(self) -> bool:
        return self._idle.pop(0)

    def step(self, msgs: list[WorkItem]) -> list[ReqOutput]:
        self.steps.append(list(msgs))
        return [ReqOutput(rid=m.rid) for m in msgs]

    def fail_all(self, reason: str) -> list[ReqOutput]:
        raise AssertionError("not called")

    def check_integrity(self) -> None:
        pass


class Stats:
    def __init__(self) -> None:
        self.turns: list[float] = []

    def observe_step(self, turn_s: float) -> None:
        self.turns.append(turn_s)


def test_the_loop_steps_every_turn_and_waits_only_when_nothing_can_run() -> None:
    stop = threading.Event()
    io = LoopIO(stop, [[AbortReq(rid="a")], [], [AbortReq(rid="b"), AbortReq(rid="c")]])
    # runnable: no wait; rooms in flight: a short wait (a transfer thread wakes it); idle: longer.
    sched = Scripted(runnable=[True, False, False], idle=[False, True])
    stats = Stats()
    serve(sched, io, stats, stop, "test")
    assert io.waits == [0.0, BUSY_WAIT_S, IDLE_WAIT_S]
    assert [[m.rid for m in msgs] for msgs in sched.steps] == [["a"], [], ["b", "c"]]
    assert [[o.rid for o in out] for out in io.sent] == [["a"], [], ["b", "c"]]
    assert len(stats.turns) == 3 and all(t >= 0 for t in stats.turns)


class Broken(Scripted):
    def step(self, msgs: list[WorkItem]) -> list[ReqOutput]:
        raise Boom("step")

    def fail_all(self, reason: str) -> list[ReqOutput]:
        raise Boom("fail_all")


def test_the_loop_survives_a_step_and_fail_all_that_both_raise() -> None:
    stop = threading.Event()
    io = LoopIO(stop, [[], [], []])
    serve(Broken(runnable=[False] * 3, idle=[True] * 3), io, Stats(), stop, "test")
    assert io.sent == [[], [], []]  # every turn still ends by sending (nothing), and the loop went on


def test_decode_step_seconds_count_only_turns_that_decoded() -> None:
    counters = DecodeCounters()
    stats = DecodeStats(SimpleNamespace(counters=counters), aux_total_slots=1)  # type: ignore[arg-type]
    stats.observe_step(0.5)  # nothing happened
    counters.decode_steps, counters.generated_tokens = 1, 3
    stats.observe_step(0.25)
    stats.observe_step(0.125)  # no new decode step
    assert counters.decode_step_seconds == 0.25
    assert stats.throughput.rate() > 0


def test_role_parts_travel_to_the_spawned_scheduler() -> None:
    """The launcher builds the role part and the spawned process unpickles it: plain data only."""
    for part in (PrefillPart(SchedulerConfig(), TransferConfig(backend="fake"), "http://127.0.0.1:8998"),
                 DecodePart(SchedulerConfig(reserved_decode_tokens=7), TransferConfig(backend="fake"), 4)):
        back = pickle.loads(pickle.dumps(part))
        assert back == part and back.role in ("prefill", "decode")
