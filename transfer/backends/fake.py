"""Fake data plane: every write "succeeds" at once and moves no bytes.

Same control plane and state machine as the real backends, so flow tests and warm-up exercise
everything but the copy; decode output is then meaningless. Selected by configuration only.
Counters make descriptor arithmetic observable, and ``fail_session`` injects write failures.
"""
from __future__ import annotations

import threading
import uuid

from transfer.base import DataPlane
from transfer.descriptors import Descriptors


class FakeDataPlane(DataPlane):
    name = "fake"

    def __init__(self, host: str = "127.0.0.1", max_batch_entries: int = 2000, **_: object) -> None:
        self._session = f"fake-{host}-{uuid.uuid4().hex[:12]}"
        self.max_batch_entries = max_batch_entries
        self._lock = threading.Lock()
        self.registered: list[tuple[int, int]] = []
        self.batches = 0
        self.descriptors = 0
        self.bytes = 0
        self._failing: set[str] = set()

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered.append((ptr, nbytes))

    def fail_session(self, peer_session: str, failing: bool = True) -> None:
        """Make writes to ``peer_session`` fail (tests)."""
        with self._lock:
            (self._failing.add if failing else self._failing.discard)(peer_session)

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        if len(desc) > self.max_batch_entries:
            return False  # mirror the real engine's per-peer batch limit
        with self._lock:
            if peer_session in self._failing:
                return False
            self.batches += 1
            self.descriptors += len(desc)
            self.bytes += sum(desc.lens)
        return True

    def close(self) -> None:
        self.registered.clear()
