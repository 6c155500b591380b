"""Per-room handles: what a scheduler holds for each request (cheap; all state lives in the manager).

``poll()`` is a dict read plus attribute reads, safe against the managers' threads because every
field it reads is replaced atomically under the manager lock. The first terminal state seen is
cached in the handle and the manager forgets the room, so later polls answer the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from transfer.aux import AuxRecord
from transfer.base import KVReceiver, KVSender
from transfer.poll import KVPoll

if TYPE_CHECKING:
    from transfer.decode import DecodeKVManager
    from transfer.prefill import PrefillKVManager


class _RoomHandle:
    """What both roles' handles share: the cached terminal state and the failure reason."""

    _default_abort_reason = "aborted"

    def __init__(self, mgr: PrefillKVManager | DecodeKVManager, room: int) -> None:
        self._mgr, self.room = mgr, room
        self._final: KVPoll | None = None
        self._reason: str | None = None

    def _poll_room(self, fenced: bool) -> KVPoll:
        """``fenced``: a Failed room with a write still in flight answers Transferring (prefill)."""
        if self._final is not None:
            return self._final
        r = self._mgr._rooms.get(self.room)
        if r is None:  # only after _release, which happens after _final is set
            return KVPoll.Failed
        status = r.status
        if fenced and status is KVPoll.Failed and r.inflight > 0:
            return KVPoll.Transferring  # a write for this room has not returned yet
        if status.terminal:
            self._final, self._reason = status, r.reason
            self._mgr._release(self.room)
        return status

    def abort(self, reason: str | None = None) -> None:
        self._mgr._abort(self.room, reason or self._default_abort_reason)

    @property
    def failure_reason(self) -> str | None:
        if self._final is not None:
            return self._reason
        r = self._mgr._rooms.get(self.room)
        return r.reason if r is not None and r.status is KVPoll.Failed else None


class PrefillKVSender(_RoomHandle, KVSender):
    _default_abort_reason = "aborted by prefill"
    _mgr: PrefillKVManager

    def send(self, page_indices: Sequence[int], last_chunk: bool, aux: AuxRecord | None = None,
             state_indices: Sequence[int] = ()) -> None:
        self._mgr._queue_chunk(self.room, page_indices, last_chunk, aux, state_indices)

    def poll(self) -> KVPoll:
        return self._poll_room(fenced=True)


class DecodeKVReceiver(_RoomHandle, KVReceiver):
    _default_abort_reason = "aborted by decode"
    _mgr: DecodeKVManager

    def init(self, page_indices: Sequence[int], aux_slot: int | None, state_indices: Sequence[int] = ()) -> None:
        self._mgr._init(self.room, page_indices, aux_slot, state_indices)

    def poll(self) -> KVPoll:
        return self._poll_room(fenced=False)

    def fenced(self) -> bool:
        return self.room in self._mgr._fenced
