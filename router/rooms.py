"""Bootstrap rooms: the random id that ties a request's prefill half to its decode half.

A request of ``count`` sequences (a batch, or n > 1) uses ``count`` consecutive rooms, base ..
base + count - 1, as the nodes derive them from one scalar room. Rooms are random in
[0, 2^63 - 1] (so two routers in front of the same nodes practically never collide) and never
equal to a room still in flight through this router. ``release`` is called exactly once per
``reserve``, on every path (the ``Rooms.hold`` context manager does it).
"""
from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

from common.pd_contract import MAX_ROOM


class Rooms:
    def __init__(self) -> None:
        self._inflight: set[int] = set()

    def __len__(self) -> int:
        return len(self._inflight)

    def reserve(self, count: int = 1) -> int:
        """The first of ``count`` consecutive rooms, none of them in flight."""
        if not 1 <= count <= 2**20:
            raise ValueError(f"cannot reserve {count} rooms")
        while True:
            base = secrets.randbelow(MAX_ROOM - count + 2)  # base + count - 1 <= MAX_ROOM
            rooms = range(base, base + count)
            if not any(r in self._inflight for r in rooms):
                self._inflight.update(rooms)
                return base

    def release(self, base: int, count: int = 1) -> None:
        rooms = range(base, base + count)
        missing = [r for r in rooms if r not in self._inflight]
        if missing:
            raise RuntimeError(f"rooms {missing[:3]} released but not in flight")
        self._inflight.difference_update(rooms)

    @contextlib.contextmanager
    def hold(self, count: int = 1) -> Iterator[int]:
        base = self.reserve(count)
        try:
            yield base
        finally:
            self.release(base, count)
