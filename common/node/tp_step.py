"""How the ranks of one node agree on a scheduler step (tp > 1).

    StepSync(group)
      .inputs(encoded, clock) -> StepInputs     rank 0's step input messages + clock, on every rank
      .agree_polls({room: state}) -> {room: state}   all-reduce MIN over the live rooms' states
      .agree_flag(flag) -> bool                  all-reduce MAX: true when any rank says true

Every rank runs the same deterministic scheduler, so it must see the same inputs at the same
step. Three things are not the same on every rank by themselves:

- the input messages: only rank 0 is linked to the API process (NodeIO), so rank 0 broadcasts
  each step's encoded messages (``broadcast_bytes``);
- the clock: every timeout and deadline decision reads rank 0's reading, sent in the same
  broadcast (8 bytes ahead of the messages), so no rank times a request out a step earlier;
- room states, which each rank's KV-manager threads change asynchronously: a room's state is
  the MIN over the ranks' local polls (``KVPoll``: Failed = 0 lowest, Success highest), so one
  rank's failure fails the room everywhere and a room is Success only when every rank's part
  arrived. The decode's ``fenced()`` (any rank fenced means the node is) is a MAX.

With tp = 1 (``SingleRank``) every method returns its input and issues no collective: the
single-process node pays one attribute check per step.

Rooms are agreed in sorted order: every rank holds the same live rooms at the same step (same
inputs, same scheduler), so the sorted lists line up. A rank whose list differs (a bug, not a
race) is caught by a fingerprint of the room ids and every rank raises rather than mixing up rooms' states.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

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
        group = self._group
        if group.size == 1:
            return dict(local)
        rooms = sorted(local)
        n = len(rooms)
        # Int hashing is not salted, so every rank computes the same fingerprint for the same rooms.
        mark = hash(tuple(rooms)) & ((1 << 62) - 1)
        counts = torch.tensor([n], dtype=torch.int64, device=group.device)  # [1]
        group.all_reduce(counts, "max")
        width = int(counts.item())
        # Slots 0-1 carry the fingerprint as MIN and (negated) as MAX: any difference shows up.
        values = torch.zeros(2 + width, dtype=torch.int64, device=group.device)  # [2 + rooms]
        if width == n:
            values[0], values[1] = mark, -mark
            values[2:] = torch.tensor([int(local[r]) for r in rooms], dtype=torch.int64)
        # A rank holding fewer rooms still joins this reduce (same width, zeros): every rank must
        # issue the same collectives, then all of them raise below.
        group.all_reduce(values, "min")
        if width != n or int(values[0].item()) != mark or -int(values[1].item()) != mark:
            raise StepDivergedError(f"tp rank {group.rank}'s {n} live rooms differ from another "
                                    f"rank's: the schedulers are out of step")
        agreed = values[2:].tolist()
        return dict(zip(rooms, (int(v) for v in agreed)))

    def agree_flag(self, flag: bool) -> bool:
        """True when any rank's ``flag`` is true (e.g. the decode's ``fenced()``)."""
        group = self._group
        if group.size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64, device=group.device)  # [1]
        return bool(group.all_reduce(value, "max").item())
