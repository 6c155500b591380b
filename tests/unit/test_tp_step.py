"""How a node's ranks agree on a step (common/node/tp_step.py): rank 0's inputs and clock reach
every rank, room states are the MIN over the ranks, a flag the MAX, a divergence raises on every
rank. Two real processes over gloo, bounded in time; tp = 1 issues no collective."""
from __future__ import annotations

from typing import Any

from tests.tp_harness import run_ranks

# KVPoll's values (transfer/poll.py): Failed 0, Bootstrapping 1, WaitingForInput 2,
# Transferring 3, Success 4. Per rank: room -> its local poll.
LOCAL = {
    0: {11: 4, 12: 4, 13: 0, 14: 3, 15: 2},
    1: {11: 4, 12: 3, 13: 4, 14: 4, 15: 2},
}
EXPECTED = {11: 4, 12: 3, 13: 0, 14: 3, 15: 2}  # each room's lowest state over the two ranks


def _rank(rank: int, port: int, out: Any) -> None:
    from common.node.tp_step import StepDivergedError, StepSync
    from common.parallel import init_tp_group

    group = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
    sync = StepSync(group)
    try:
        first = sync.inputs(b"\x01step-one" if rank == 0 else None, 123.25 if rank == 0 else None)
        empty = sync.inputs(b"" if rank == 0 else None, 124.5 if rank == 0 else None)
        polls = sync.agree_polls(LOCAL[rank])
        none = sync.agree_polls({})
        fenced = sync.agree_flag(rank == 1)
        calm = sync.agree_flag(False)
        try:  # rank 1 holds a room rank 0 does not: both must raise, neither may hang
            sync.agree_polls({21: 4} if rank == 0 else {21: 4, 22: 4})
            short = "no error"
        except StepDivergedError:
            short = "diverged"
        try:  # same count, different rooms
            sync.agree_polls({31: 4} if rank == 0 else {32: 4})
            swapped = "no error"
        except StepDivergedError:
            swapped = "diverged"
        out.put((rank, first.encoded, first.clock, empty.encoded, empty.clock, polls, none,
                 fenced, calm, short, swapped))
    finally:
        group.close()


def test_step_agreement_over_two_ranks() -> None:
    got, exitcodes = run_ranks(_rank)
    assert len(got) == 2, "a rank did not report within the time limit"
    for rank, encoded, clock, empty, empty_clock, polls, none, fenced, calm, short, swapped in got:
        assert (encoded, clock) == (b"\x01step-one", 123.25), rank
        assert (empty, empty_clock) == (b"", 124.5), rank
        assert polls == EXPECTED, rank
        assert none == {}
        assert fenced is True and calm is False
        assert (short, swapped) == ("diverged", "diverged"), rank
    assert exitcodes == [0, 0]


def test_single_rank_issues_no_collective() -> None:
    """tp = 1: every method returns its input; a group whose collectives raise proves none ran."""
    from common.node.tp_step import StepSync
    from common.parallel import SingleRank

    class NoCollectives(SingleRank):
        def all_reduce(self, tensor, op="sum"):  # type: ignore[no-untyped-def]
            raise AssertionError("tp = 1 ran an all-reduce")

        def broadcast(self, tensor, src=0):  # type: ignore[no-untyped-def]
            raise AssertionError("tp = 1 ran a broadcast")

    sync = StepSync(NoCollectives())
    step = sync.inputs(b"msgs", 9.5)
    assert (step.encoded, step.clock) == (b"msgs", 9.5)
    assert sync.agree_polls({5: 0, 3: 4}) == {5: 0, 3: 4}
    assert sync.agree_flag(True) is True and sync.agree_flag(False) is False
