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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from common.parallel import TPGroup
from transfer.errors import TransferError
from transfer.poll import KVPoll

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


# -- room handles every rank reads the same ------------------------------------------------------


class AgreedHandle:
    """A scheduler's view of one room's handle on a TP node: ``poll()`` and ``fenced()`` answer
    the values the ranks agreed on at the start of this step (``AgreedRooms.refresh``), so every
    rank's scheduler takes the same branch. Actions (``send``, ``init``, ``abort``) go to this
    rank's own handle: every rank sends its own part, with the same page ids."""

    __slots__ = ("inner", "room", "_state", "_fenced")

    def __init__(self, inner: Any) -> None:
        self.inner, self.room = inner, inner.room
        # Until the first agreement: the state every room starts in, on every rank.
        self._state, self._fenced = KVPoll.Bootstrapping, False

    def poll(self) -> KVPoll:
        return self._state

    def fenced(self) -> bool:
        return self._fenced

    @property
    def failure_reason(self) -> str | None:
        if self._state is not KVPoll.Failed:
            return None
        return self.inner.failure_reason or "its transfer failed on another TP rank of this node"

    def send(self, *args: Any, **kwargs: Any) -> None:
        self.inner.send(*args, **kwargs)

    def init(self, *args: Any, **kwargs: Any) -> None:
        self.inner.init(*args, **kwargs)

    def abort(self, reason: str | None = None) -> None:
        self.inner.abort(reason)


_GAUGES = -1  # the key under which each rank's room count rides along with the rooms' states


class AgreedRooms:
    """The live room handles of one rank, agreed with the other ranks once per step.

    A handle is tracked from creation (in creation order, which is the same on every rank) until
    its agreed state is terminal and it is not fenced; after that its answers never change, so
    it needs no more agreement. Each refresh is two small all-reduces for all live rooms
    together (``StepSync.agree_min``): a room's state is the MIN over the ranks, its fence the MAX.
    """

    def __init__(self, sync: StepSync, local_rooms: Callable[[], int] = lambda: 0) -> None:
        """``local_rooms``: this rank's manager's room count; the refresh carries it along, so
        ``max_rooms`` (what a TP node's /debug/memory reports) covers every rank's rooms."""
        self._sync = sync
        self._local_rooms = local_rooms
        self.max_rooms = 0
        self._live: dict[int, AgreedHandle] = {}
        self._seq = 0
        # Local handles a rank aborted because another rank refused their room: polled here (no
        # agreement: the scheduler never saw them) until terminal, which releases their room.
        self._untracked: list[Any] = []

    def track(self, inner: Any) -> AgreedHandle:
        handle = AgreedHandle(inner)
        self._live[self._seq] = handle
        self._seq += 1
        return handle

    def create(self, make: Callable[[], Any]) -> AgreedHandle:
        """``make()`` on every rank; if it raised on any rank, the ranks where it did not abort
        their new handle, and every rank raises (the local error, or a ``TransferError`` saying
        another rank refused), so no rank holds a room the others do not."""
        try:
            inner, error = make(), None
        except TransferError as exc:
            inner, error = None, exc
        if self._sync.agree_all(error is None):
            return self.track(inner)
        if inner is not None:
            inner.abort("refused on another TP rank of this node")
            self._untracked.append(inner)
            raise TransferError("another TP rank of this node refused the room", inner.room)
        assert error is not None
        raise error

    def refresh(self) -> None:
        """Every rank, at the start of every step, before the scheduler polls."""
        self._poll_untracked()
        local = {seq: (int(h.inner.poll()), -int(_fenced(h.inner))) for seq, h in self._live.items()}
        local[_GAUGES] = (-self._local_rooms(), 0)
        agreed = self._sync.agree_min(local, 2)
        self.max_rooms = -agreed.pop(_GAUGES)[0]
        for seq, (state, neg_fenced) in agreed.items():
            h = self._live[seq]
            h._state, h._fenced = KVPoll(state), neg_fenced < 0
            if h._state.terminal and not h._fenced:
                del self._live[seq]

    def _poll_untracked(self) -> None:
        self._untracked = [h for h in self._untracked if not h.poll().terminal]

    def __len__(self) -> int:
        return len(self._live)


def _fenced(handle: Any) -> bool:
    """A decode receiver's fence (a prefill sender has none)."""
    fenced = getattr(handle, "fenced", None)
    return bool(fenced()) if fenced is not None else False


class AgreedManager:
    """A role's KV manager as a TP rank's scheduler sees it: the handles it creates are agreed
    (``AgreedRooms``); everything else is the rank's own manager."""

    def __init__(self, inner: Any, rooms: AgreedRooms) -> None:
        self._inner, self._rooms = inner, rooms

    def create_sender(self, room: int, prompt_digest: str = "") -> AgreedHandle:
        return self._rooms.create(lambda: self._inner.create_sender(room, prompt_digest=prompt_digest))

    def create_receiver(self, room: int, bootstrap_addr: str) -> AgreedHandle:
        return self._rooms.create(lambda: self._inner.create_receiver(room, bootstrap_addr))

    def num_rooms(self) -> int:
        """The most rooms any rank's manager holds (as of this step's agreement)."""
        return max(self._inner.num_rooms(), self._rooms.max_rooms)

    def __getattr__(self, name: str) -> Any:  # reject_room, num_fenced, ...: this rank's own
        return getattr(self._inner, name)


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
    The default is one rank's: the real clock, every verdict its own."""

    clock: Callable[[], float] = time.monotonic
    agree_all: Callable[[bool], bool] = _same
    agree_min_int: Callable[[int], int] = _same

    @classmethod
    def of(cls, sync: StepSync, clock: StepClock) -> RankAgreement:
        return cls(clock=clock, agree_all=sync.agree_all, agree_min_int=sync.agree_min_int)


ONE_RANK = RankAgreement()
