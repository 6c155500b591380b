"""Room handles every TP rank of a node reads the same (tp > 1; ``common.node.tp_step``).

    agreed_manager(manager, agreement) -> the manager the role's scheduler gets
      tp = 1: ``manager`` itself
      tp > 1: AgreedManager: its handles are AgreedHandles; AgreedRooms.refresh runs before each step

Each rank's KV-manager threads move its own room states; a scheduler that read them directly
would branch differently on different ranks. So the scheduler's handles answer the values the
ranks agreed at the start of the step: a room's state is the MIN over the ranks (``KVPoll``:
Failed lowest, Success highest: one rank's failure fails the room, Success needs every rank's
part), its fence the MAX. Actions (``send``, ``init``, ``abort``) stay each rank's own.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.node.tp_step import RankAgreement, StepSync
from transfer.errors import TransferError
from transfer.poll import KVPoll


def agreed_manager(manager: Any, agreement: RankAgreement) -> Any:
    """What a role gives its scheduler in place of ``manager``: itself on one rank, else a view
    whose handles are agreed (their refresh registered with ``agreement.before_step``)."""
    if agreement.sync is None:
        return manager
    rooms = AgreedRooms(agreement.sync, manager.num_rooms)
    agreement.before_step(rooms.refresh)
    return AgreedManager(manager, rooms)


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

    @property
    def resharded(self) -> bool:  # fixed by the two nodes' TP sizes: the same on every rank
        return bool(getattr(self.inner, "resharded", False))

    @property
    def decode_prefix_len(self) -> int:  # from the decode's TransferInfos, which every rank got alike
        return int(getattr(self.inner, "decode_prefix_len", 0))

    def send(self, *args: Any, **kwargs: Any) -> None:
        self.inner.send(*args, **kwargs)

    def init(self, *args: Any, **kwargs: Any) -> None:
        self.inner.init(*args, **kwargs)

    def abort(self, reason: str | None = None) -> None:
        self.inner.abort(reason)


_GAUGES = -1  # the key under which each rank's room count rides along with the rooms' states
_IN_FLIGHT_ONLY = len(KVPoll)  # above every state: a terminal rank does not count in the in-flight MIN


class AgreedRooms:
    """The live room handles of one rank, agreed with the other ranks once per step.

    A handle is tracked from creation (in creation order, which is the same on every rank) until
    its agreed state is terminal and it is not fenced; after that its answers never change, so
    it needs no more agreement. Each refresh is two small all-reduces for all live rooms
    together (``StepSync.agree_min``): a room is terminal once it is on every rank (then Failed
    if any rank failed), its fence is the MAX over the ranks.
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
        """Every rank, at the start of every step, before the scheduler polls.

        A room is terminal for the scheduler only once it is terminal on every rank: a rank whose
        part is still in flight may still be written (decode) or read (prefill) through its pages,
        so the scheduler must not free them yet. Until then it sees the lowest state among the
        ranks still in flight; a rank that learns another failed aborts its own part, so the
        room ends everywhere within the transfer layer's bounds."""
        self._poll_untracked()
        local = {}
        for seq, h in self._live.items():
            state = h.inner.poll()
            local[seq] = (int(state), int(state.terminal), _IN_FLIGHT_ONLY if state.terminal else int(state),
                          -int(_fenced(h.inner)))
        local[_GAUGES] = (-self._local_rooms(), 0, 0, 0)
        agreed = self._sync.agree_min(local, 4)
        self.max_rooms = -agreed.pop(_GAUGES)[0]
        for seq, (lowest, all_terminal, lowest_in_flight, neg_fenced) in agreed.items():
            h = self._live[seq]
            if all_terminal:
                h._state = KVPoll(lowest)  # Failed if any rank failed, else Success
            else:
                h._state = KVPoll(lowest_in_flight)
                if lowest == KVPoll.Failed and not h.inner.poll().terminal:
                    h.inner.abort("its transfer failed on another TP rank of this node")
            h._fenced = neg_fenced < 0
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
