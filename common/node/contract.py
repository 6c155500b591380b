"""The contract between the node loop (``common.node.process``) and a role's scheduler and stats.

Both roles' schedulers (``prefill_node.scheduler``, ``decode_node.scheduler``) keep it::

    loop turn:  msgs = NodeIO.recv(wait)      wait: 0 if scheduler.runnable() else longer
                outputs = scheduler.step(msgs)      (scheduler.fail_all(reason) if step raised)
                NodeIO.send(outputs)
                stats.observe_step(turn seconds)

Plain data in (``GenerateReq`` / ``AbortReq``), plain data out (``ReqOutput``): unit tests drive a
scheduler with hand-made messages and collaborators, no process, socket or model. Each scheduler
collects a step's outputs in its ``outbox`` list, keeps its running totals in a counters
dataclass (``PrefillCounters``, ``DecodeCounters``) and its queues in a plain queues object.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from common.ipc.node_io import NodeStats
from common.ipc.protocol import ReqOutput, WorkItem


class NodeScheduler(Protocol):
    def step(self, msgs: Sequence[WorkItem]) -> list[ReqOutput]:
        """Take this turn's messages (in arrival order), move every queue once, and return every
        output produced since the last call (answers, streamed tokens). Never blocks."""
        ...

    def fail_all(self, reason: str) -> list[ReqOutput]:
        """The net after ``step`` raised: fail every live request (500, ``reason``), each still
        released exactly once (now, or by later steps once no transfer reads its pages). Returns
        the outputs not handed out yet, those of the failed step included."""
        ...

    def runnable(self) -> bool:
        """A forward is likely next step: the loop should not wait for input."""
        ...

    def idle(self) -> bool:
        """Nothing in flight at all: the loop may wait longest for input."""
        ...

    def check_integrity(self) -> None:
        """Pools consistent and every live request in exactly one queue (tests call it after
        every step)."""
        ...


class StepStats(NodeStats, Protocol):
    """A role's stats: answers the ops queries (``NodeStats``) and watches the loop."""

    def observe_step(self, turn_s: float) -> None:
        """After each loop turn: ``turn_s`` from taking input (or from the turn's start when no
        wait was allowed) to outputs sent."""
        ...
