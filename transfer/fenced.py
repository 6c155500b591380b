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


class FencedRooms:
    """Bookkeeping only (no locking, no I/O): the manager calls it under its own lock."""

    def __init__(self) -> None:
        self._rooms: dict[int, Fenced] = {}

    def hold(self, entry: Fenced) -> None:
        self._rooms[entry.room] = entry
        log.warning("room %d: pages fenced until prefill %s is proven unable to write", entry.room, entry.endpoint)

    def get(self, room: int) -> Fenced | None:
        return self._rooms.get(room)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def release(self, room: int, why: str) -> bool:
        """Drop ``room`` (True) or do nothing if it is not held (False): each room once."""
        entry = self._rooms.pop(room, None)
        if entry is None:
            return False
        log.warning("room %d: fence lifted after %.1f s: %s", room, time.monotonic() - entry.since, why)
        return True

    def endpoints(self) -> dict[str, tuple[str, int, str | None]]:
        """Each endpoint with held rooms -> (host, port, instance_id) to probe."""
        return {e.endpoint: (e.host, e.port, e.instance_id) for e in self._rooms.values()}

    def older_than(self, max_s: float, now: float) -> list[int]:
        """Rooms held for more than ``max_s`` seconds (none when ``max_s`` is 0)."""
        return [] if max_s <= 0 else [e.room for e in self._rooms.values() if now - e.since > max_s]

    def rooms_of(self, endpoint: str) -> list[int]:
        return [e.room for e in self._rooms.values() if e.endpoint == endpoint]
