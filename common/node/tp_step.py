"""How the ranks of one node agree on a scheduler step (tp > 1).

    StepSync(group)
      .inputs(encoded, clock) -> StepInputs     rank 0's step input messages + clock, on every rank
      .agree_min({key: values}, width)           all-reduce MIN per key (room states: transfer/agreed.py)
      .agree_polls({room: state}) -> {room: state}   the same for one value per room
      .agree_flag(flag) / .agree_all(flag)       all-reduce MAX / MIN of a flag
      .agree_min_int(value)                      all-reduce MIN of one int
    StepClock                                    rank 0's clock of the step, what a scheduler reads
    RankAgreement                                what a role part gets: clock, verdicts, step hooks

Every rank runs the same deterministic scheduler, so it must see the same inputs at the same
step. Four things are not the same on every rank by themselves:

- the input messages: only rank 0 is linked to the API process (NodeIO), so rank 0 broadcasts
  each step's encoded messages (``broadcast_bytes``);
- the clock: every timeout and deadline decision reads rank 0's reading, sent in the same
  broadcast (8 bytes ahead of the messages), so no rank times a request out a step earlier;
- room states, which each rank's KV-manager threads change asynchronously: a room's state is
  the MIN over the ranks' local polls (``KVPoll``: Failed = 0 lowest, Success highest), so one
  rank's failure fails the room everywhere and a room is Success only when every rank's part
  arrived. The decode's ``fenced()`` (any rank fenced means the node is) is a MAX;
- verdicts of checks each rank runs on its own heads (KV integrity): ``agree_all``/``agree_min_int``.

With tp = 1 (``SingleRank``) every method returns its input and issues no collective: the
single-process node pays one attribute check per step.

Keys are agreed in sorted order: every rank holds the same live rooms at the same step (same
inputs, same scheduler), so the sorted lists line up. A rank whose list differs (a bug, not a
race) is caught by a fingerprint of the keys and every rank raises rather than mixing up rooms' states.
"""
from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from common.parallel import TPGroup

_CLOCK = struct.Struct("<d")  # rank 0's clock reading, ahead of the step's messages


class StepDivergedError(RuntimeError):
    """The ranks' live rooms differ at a step: their schedulers are no longer in step."""


@dataclass(frozen=True, slots=True)
class StepInputs:
    encoded: bytes  # rank 0's encoded input messages for this step (empty: none)
    clock: float  # rank 0's clock reading for this step


class StepSync:
    """One node's per-step agreement; every rank calls each method once per step, in the same
    order (a collective one rank skips hangs the others until the group's timeout)."""

    def __init__(self, group: TPGroup) -> None:
        self._group = group

    @property
    def group(self) -> TPGroup:
        return self._group

    def inputs(self, encoded: bytes | None, clock: float | None) -> StepInputs:
        """Rank 0 passes its step's messages and clock; other ranks pass None and get rank 0's."""
        group = self._group
        if group.size == 1:
            assert encoded is not None and clock is not None
            return StepInputs(encoded, clock)
        mine = None
        if group.is_first:
            assert encoded is not None and clock is not None
            mine = _CLOCK.pack(clock) + encoded
        data = group.broadcast_bytes(mine, src=0)
        (agreed_clock,) = _CLOCK.unpack_from(data)
        return StepInputs(data[_CLOCK.size:], agreed_clock)

    def agree_polls(self, local: Mapping[int, int]) -> dict[int, int]:
        """Room id -> agreed state: the MIN over the ranks of each rank's local poll value."""
        return {k: v[0] for k, v in self.agree_min({k: (v,) for k, v in local.items()}, 1).items()}

    def agree_min(self, local: Mapping[int, tuple[int, ...]], width: int) -> dict[int, tuple[int, ...]]:
        """Key -> the element-wise MIN over the ranks of each rank's ``width`` values for that
        key (negate a value to get its MAX). Every rank must hold the same keys."""
        group = self._group
        if group.size == 1:
            return dict(local)
        keys = sorted(local)
        n = len(keys)
        # Int hashing is not salted, so every rank computes the same fingerprint for the same keys.
        mark = hash(tuple(keys)) & ((1 << 62) - 1)
        counts = torch.tensor([n], dtype=torch.int64, device=group.device)  # [1]
        group.all_reduce(counts, "max")
        most = int(counts.item())
        # Slots 0-1 carry the fingerprint as MIN and (negated) as MAX: any difference shows up.
        values = torch.zeros(2 + most * width, dtype=torch.int64, device=group.device)  # [2 + keys*width]
        if most == n:
            values[0], values[1] = mark, -mark
            if n:
                values[2:] = torch.tensor([x for k in keys for x in local[k]], dtype=torch.int64)
        # A rank holding fewer keys still joins this reduce (same size, zeros): every rank must
        # issue the same collectives, then all of them raise below.
        group.all_reduce(values, "min")
        if most != n or int(values[0].item()) != mark or -int(values[1].item()) != mark:
            raise StepDivergedError(f"tp rank {group.rank}'s {n} live rooms differ from another "
                                    f"rank's: the schedulers are out of step")
        agreed = values[2:].view(n, width).tolist()
        return {k: tuple(int(x) for x in row) for k, row in zip(keys, agreed)}

    def agree_min_int(self, value: int) -> int:
        """The MIN of ``value`` over the ranks (e.g. the first prefix page any rank finds changed)."""
        group = self._group
        if group.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=group.device)  # [1]
        return int(group.all_reduce(t, "min").item())

    def agree_all(self, flag: bool) -> bool:
        """True when every rank says true (e.g. "the KV that arrived here is intact")."""
        return self.agree_min_int(int(flag)) == 1

    def agree_flag(self, flag: bool) -> bool:
        """True when any rank's ``flag`` is true (e.g. the decode's ``fenced()``)."""
        group = self._group
        if group.size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64, device=group.device)  # [1]
        return bool(group.all_reduce(value, "max").item())


class StepClock:
    """The clock a TP rank's scheduler reads: rank 0's reading at the start of the step, set by
    the loop, so a timeout fires at the same step on every rank."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class RankAgreement:
    """What a role's scheduler reads that is not the same on every rank by itself: the clock and
    the verdicts of local checks (e.g. KV integrity, which each rank runs on its own heads).
    Calls happen where every rank's scheduler runs the same code, so the collectives line up.
    The default is one rank's: the real clock, every verdict its own, no ``sync``.

    ``sync`` (tp > 1) is for what a role agrees by itself: its room handles (``transfer.agreed``),
    whose refresh it registers with ``before_step``; the node loop runs those at the start of
    every step, before the scheduler's."""

    clock: Callable[[], float] = time.monotonic
    agree_all: Callable[[bool], bool] = _same
    agree_min_int: Callable[[int], int] = _same
    sync: StepSync | None = None
    step_hooks: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def of(cls, sync: StepSync, clock: StepClock) -> RankAgreement:
        return cls(clock=clock, agree_all=sync.agree_all, agree_min_int=sync.agree_min_int, sync=sync)

    def before_step(self, hook: Callable[[], None]) -> None:
        self.step_hooks.append(hook)


ONE_RANK = RankAgreement()
