"""The decode's holding set: rooms that failed to their client while a write may still land.

A room bound to a prefill that stopped answering is failed after heartbeat bound + quarantine
(the client hears within seconds), but nothing proves that the prefill's last engine write for
it has returned: a paused process can resume mid-batch. Such a room's pages, aux slot and state
items are *fenced*: the scheduler keeps them out of its pools until ``DecodeKVManager`` proves
the peer can no longer write, by one of

- any ``TransferStatus`` for the room (the prefill sends it only after its writes returned);
- the peer's control port refusing connections (its process is gone);
- a ``Pong`` on that endpoint from another instance (the old process released the port).

- ``max_fence_s`` (``PDC_MAX_FENCE_S``, default 300 s) passing: a peer that never answers (hung,
  or a stranger's listener) cannot hold a decode's memory for longer. This is the one release
  without proof: a prefill paused longer than that and then resumed could still write into pages
  given to another request since; with KV digests on (the default) such a write is caught if it
  lands before that request's KV is checked on arrival, not after. 0 keeps the old rule (held
  until proven unable to write).

Held rooms are visible (``fenced_rooms`` in /debug/memory, the ``fenced_reqs`` gauge, a warning
per room) and are not a leak.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fenced:
    room: int
    endpoint: str  # the prefill rank's control endpoint
    host: str
    port: int
    instance_id: str | None  # the prefill process that may still write
    since: float
    rank: int = 0  # the prefill rank (a room written by several ranks is held per rank)


class FencedRooms:
    """Bookkeeping only (no locking, no I/O): the manager calls it under its own lock.

    A room written by several prefill ranks (unequal TP) is held once per rank that may still
    write, and released when the last of them is proven unable to: ``on_released(room)`` then
    runs (the manager gives back the room's staging pages)."""

    def __init__(self, on_released: Callable[[int], None] | None = None) -> None:
        self._rooms: dict[int, dict[str, Fenced]] = {}  # room -> endpoint -> entry
        self._on_released = on_released

    def hold(self, entry: Fenced) -> None:
        self._rooms.setdefault(entry.room, {})[entry.endpoint] = entry
        log.warning("room %d: pages fenced until prefill %s is proven unable to write", entry.room, entry.endpoint)

    def get(self, room: int, endpoint: str) -> Fenced | None:
        return self._rooms.get(room, {}).get(endpoint)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def release(self, room: int, why: str) -> bool:
        """Drop ``room`` whole (True) or do nothing if it is not held (False): each room once."""
        entries = self._rooms.pop(room, None)
        if entries is None:
            return False
        since = min((e.since for e in entries.values()), default=time.monotonic())
        log.warning("room %d: fence lifted after %.1f s: %s", room, time.monotonic() - since, why)
        if self._on_released is not None:
            self._on_released(room)
        return True

    def release_endpoint(self, room: int, endpoint: str, why: str) -> bool:
        """``endpoint`` can no longer write into ``room``; True when that lifted the room's fence."""
        entries = self._rooms.get(room)
        if entries is None or entries.pop(endpoint, None) is None:
            return False
        return self.release(room, why) if not entries else False

    def release_rank(self, room: int, rank: int, why: str) -> bool:
        """Prefill rank ``rank`` answered for ``room`` (after its last write); True when that lifted the fence."""
        entry = next((e for e in self._rooms.get(room, {}).values() if e.rank == rank), None)
        return False if entry is None else self.release_endpoint(room, entry.endpoint, why)

    def endpoints(self) -> dict[str, tuple[str, int, str | None]]:
        """Each endpoint with held rooms -> (host, port, instance_id) to probe."""
        return {e.endpoint: (e.host, e.port, e.instance_id) for es in self._rooms.values() for e in es.values()}

    def older_than(self, max_s: float, now: float) -> list[int]:
        """Rooms held for more than ``max_s`` seconds (none when ``max_s`` is 0)."""
        if max_s <= 0:
            return []
        return [room for room, es in self._rooms.items() if es and now - min(e.since for e in es.values()) > max_s]

    def rooms_of(self, endpoint: str) -> list[int]:
        return [room for room, es in self._rooms.items() if endpoint in es]
