"""The room table: what a KV manager keeps per room, and the one lock that guards it.

Both managers hold one ``RoomTable``; their handles (``transfer.handles``) read it, and their
threads change it. A record is what one role knows of one room (``PrefillRoom``,
``DecodeRoom``); the table maps room ids to records and, on the prefill, remembers for a while
why a released room failed (its *tombstone*), so a late message for it is still answered.

Lock discipline::

    table.lock       guards every record's fields and the table itself, and the other tables of
                     the manager that owns it (the prefill's decode registry and orphans, the
                     decode's prefill-rank cache and holding set): one lock, so a change that
                     spans a room and a peer is never seen half done
    *_locked         methods (here and in the managers' parts) expect the caller to hold it
    release()        takes it itself (a handle calls it on the scheduler's thread)
    get(), in, len   one dict read, safe without it: the scheduler's ``poll()`` never waits for
                     it (each field it reads is replaced whole, under the lock, by the writer)

State changes go through ``advance_locked``: forward only (``can_advance``), and each one tells
the manager's state listener, so the scheduler's wait ends at once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from transfer import messages as m
from transfer.peers import Peer
from transfer.poll import KVPoll, can_advance, no_listener
from transfer.tp_map import HeadSlice

log = logging.getLogger(__name__)


class RoomRecord(Protocol):
    """What every record has; ``answer()`` is what the room's handle reports now."""

    room: int
    status: KVPoll
    reason: str | None

    def answer(self) -> KVPoll: ...


@dataclass
class PrefillRoom:
    room: int
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str | None = None
    infos: dict[str, m.TransferInfo] = field(default_factory=dict)  # by decode session
    prompt_digest: str = ""  # the prompt this room computes ("" : not bound)
    decode_prefix_len: int = 0  # prompt tokens the decode holds already (every info agrees)
    inflight: int = 0  # chunks a worker is writing right now
    pages_queued: int = 0
    last_queued: bool = False
    failure_sent: bool = False

    def answer(self) -> KVPoll:
        """The fence: a failed room with a write still in flight answers Transferring, so its
        pages are freed (here and on the decode) only after the last write to them returned."""
        status = self.status
        if status is KVPoll.Failed and self.inflight > 0:
            return KVPoll.Transferring
        return status


@dataclass
class DecodeRoom:
    """One room on a decode rank. Under TP it is written by every prefill rank in ``sources`` and
    sent a TransferInfo by every rank in ``links`` (its sources and any unused replica this rank
    tells it has nothing to send, ``transfer.tp_map``): it succeeds when every source said Success,
    and fails, once a failure is decided (``pending_fail``), only when every source answered or
    is proven gone, so no write of any rank can land after the caller freed its pages."""

    room: int
    bootstrap_addr: str
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str | None = None
    links: dict[int, Peer] = field(default_factory=dict)  # prefill rank -> peer, once resolved
    sources: tuple[int, ...] = ()  # the ranks of ``links`` that write into it
    required: dict[int, int] = field(default_factory=dict)  # prefill rank -> its required_dst_info_num
    answered: dict[int, bool] = field(default_factory=dict)  # rank -> said Success / failed or proven gone
    slices: tuple[HeadSlice, ...] = ()  # the head slices this rank receives (transfer.tp_map)
    scatter: bool = False  # some land in staging pages first (transfer.staging)
    # From a prefill of another TP size: the prefill's KV digest (of its own heads) cannot be
    # checked against this rank's pages, which hold other head ranges.
    resharded: bool = False
    dst_pages: list[int] = field(default_factory=list)
    staging: list[tuple[int, int]] = field(default_factory=list)  # staging extents held (scatter only)
    scattering: bool = False  # every source said Success; the status thread copies staging -> pages
    info_sent_at: float | None = None  # TransferInfo queued: the prefill may write from now on
    pending_fail: str | None = None  # failure decided, waiting for the fence
    fence_deadline: float = field(default=float("inf"))

    def answer(self) -> KVPoll:
        return self.status

    @property
    def resolved(self) -> bool:
        return bool(self.links)

    def silent_sources(self) -> list[int]:
        """Sources that have not answered (a write of theirs may still land)."""
        return [p for p in self.sources if p not in self.answered]

    def unanswered(self) -> list[Peer]:
        """Linked ranks that have not answered, each once."""
        return [peer for p, peer in self.links.items() if p not in self.answered]

    def rank_of(self, endpoint: str) -> int | None:
        return next((p for p, peer in self.links.items() if peer.endpoint == endpoint), None)


R = TypeVar("R", bound=RoomRecord)


class RoomTable(Generic[R]):
    """Rooms in flight on one manager (see the module docstring for the lock discipline).

    ``tombstone_s``: how long a released failed room, or a room failed before it existed here,
    keeps its reason (None: no tombstones).
    """

    def __init__(self, tombstone_s: float | None = None) -> None:
        self.lock = threading.Lock()
        self._rooms: dict[int, R] = {}
        self._tombstone_s = tombstone_s
        self._tombstones: dict[int, tuple[float, str]] = {}  # room -> (expiry, reason)
        self._listener: Callable[[], None] = no_listener

    def set_listener(self, fn: Callable[[], None]) -> None:
        """``fn`` runs (on a transfer thread, the lock held: it must be quick and never block)
        whenever a handle's ``poll()`` answer may have changed."""
        self._listener = fn

    def changed_locked(self) -> None:
        """Tell the listener (lock held) of a change ``advance_locked`` did not make itself."""
        self._listener()

    # --- lookups -------------------------------------------------------------------------------
    def get(self, room: int) -> R | None:
        return self._rooms.get(room)

    def __getitem__(self, room: int) -> R:
        return self._rooms[room]

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def records_locked(self) -> list[R]:
        """Every record, as a list the caller may iterate while changing the table (lock held)."""
        return list(self._rooms.values())

    def ids_locked(self) -> list[int]:
        return sorted(self._rooms)

    # --- changes -------------------------------------------------------------------------------
    def insert_locked(self, record: R) -> R:
        """Add a room the caller checked is not in the table."""
        if record.room in self._rooms:
            raise ValueError(f"room {record.room} is already in the table")
        self._rooms[record.room] = record
        return record

    def advance_locked(self, r: R, status: KVPoll, reason: str | None = None) -> bool:
        """Move ``r`` to ``status`` if that is a legal move (lock held); True when it moved."""
        if not can_advance(r.status, status):
            return False
        r.status, r.reason = status, reason
        self._listener()
        if status is KVPoll.Failed:
            log.warning("room %d failed: %s", r.room, reason)
        return True

    def release(self, room: int) -> None:
        """A handle saw a terminal state: forget the room (a failed one leaves a tombstone)."""
        with self.lock:
            r = self._rooms.pop(room, None)
            if r is not None and r.status is KVPoll.Failed and self._tombstone_s is not None:
                self.tombstone_locked(room, r.reason or "failed")

    # --- tombstones (lock held) ----------------------------------------------------------------
    def tombstone_locked(self, room: int, reason: str) -> None:
        assert self._tombstone_s is not None, "this table keeps no tombstones"
        self._tombstones[room] = (time.monotonic() + self._tombstone_s, reason)

    def tombstone_reason_locked(self, room: int) -> str | None:
        tomb = self._tombstones.get(room)
        return None if tomb is None else tomb[1]

    def take_tombstone_locked(self, room: int) -> str | None:
        tomb = self._tombstones.pop(room, None)
        return None if tomb is None else tomb[1]

    def expire_tombstones_locked(self, now: float) -> None:
        for room in [room for room, (expiry, _) in self._tombstones.items() if now > expiry]:
            del self._tombstones[room]

    def tombstoned_locked(self) -> list[int]:
        return sorted(self._tombstones)
