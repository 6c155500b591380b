"""Per-room handles: what a scheduler holds for each request (cheap; all state lives in the manager).

A handle reads its room in the manager's ``RoomTable`` (``transfer.rooms``) and asks the manager
to act through the small protocols below, which the managers satisfy; it never sees the manager
itself. ``poll()`` is a dict read plus attribute reads, safe against the managers' threads
because every field it reads is replaced atomically under the table's lock. The first terminal
state seen is cached in the handle and the table forgets the room, so later polls answer the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from transfer.aux import AuxRecord
from transfer.base import KVReceiver, KVSender
from transfer.poll import KVPoll
from transfer.rooms import RoomTable


class RoomActions(Protocol):
    def abort_room(self, room: int, reason: str) -> None:
        """Fail ``room`` (idempotent); the peer is told."""


class SenderActions(RoomActions, Protocol):
    def queue_chunk(self, room: int, pages: Sequence[int], last: bool, aux: AuxRecord | None,
                    state: Sequence[int]) -> None:
        """``KVSender.send``: queue the chunk for a transfer worker, or fail the room."""


class ReceiverActions(RoomActions, Protocol):
    def init_room(self, room: int, pages: Sequence[int], aux_slot: int | None, state: Sequence[int],
                  prompt_digest: str = "", decode_prefix_len: int = 0) -> None:
        """``KVReceiver.init``: send the room's TransferInfo."""

    def is_fenced(self, room: int) -> bool:
        """The room is in the holding set (``transfer.fenced``)."""


class _RoomHandle:
    """What both roles' handles share: the cached terminal state and the failure reason."""

    _default_abort_reason = "aborted"

    def __init__(self, rooms: RoomTable[Any], actions: RoomActions, room: int) -> None:
        self._rooms, self.room = rooms, room
        self._actions = actions
        self._final: KVPoll | None = None
        self._reason: str | None = None

    def poll(self) -> KVPoll:
        if self._final is not None:
            return self._final
        r = self._rooms.get(self.room)
        if r is None:  # only after release, which happens after _final is set
            return KVPoll.Failed
        status = r.answer()
        if status.terminal:
            self._final, self._reason = status, r.reason
            self._on_final(r)
            self._rooms.release(self.room)
        return status

    def abort(self, reason: str | None = None) -> None:
        self._actions.abort_room(self.room, reason or self._default_abort_reason)

    def _on_final(self, record: Any) -> None:
        """Keep what a caller may still ask once the table forgot the room."""

    @property
    def failure_reason(self) -> str | None:
        if self._final is not None:
            return self._reason
        r = self._rooms.get(self.room)
        return r.reason if r is not None and r.status is KVPoll.Failed else None


class PrefillKVSender(_RoomHandle, KVSender):
    _default_abort_reason = "aborted by prefill"
    _actions: SenderActions

    def __init__(self, rooms: RoomTable[Any], actions: SenderActions, room: int) -> None:
        super().__init__(rooms, actions, room)
        self._prefix_len = 0

    def _on_final(self, record: Any) -> None:
        self._prefix_len = record.decode_prefix_len

    @property
    def decode_prefix_len(self) -> int:
        r = self._rooms.get(self.room)
        return self._prefix_len if r is None else r.decode_prefix_len

    def send(self, page_indices: Sequence[int], last_chunk: bool, aux: AuxRecord | None = None,
             state_indices: Sequence[int] = ()) -> None:
        self._actions.queue_chunk(self.room, page_indices, last_chunk, aux, state_indices)


class DecodeKVReceiver(_RoomHandle, KVReceiver):
    _default_abort_reason = "aborted by decode"
    _actions: ReceiverActions

    def __init__(self, rooms: RoomTable[Any], actions: ReceiverActions, room: int) -> None:
        super().__init__(rooms, actions, room)
        self._resharded = False

    def _on_final(self, record: Any) -> None:
        self._resharded = record.resharded

    def init(self, page_indices: Sequence[int], aux_slot: int | None, state_indices: Sequence[int] = (),
             prompt_digest: str = "", decode_prefix_len: int = 0) -> None:
        self._actions.init_room(self.room, page_indices, aux_slot, state_indices, prompt_digest, decode_prefix_len)

    def fenced(self) -> bool:
        return self._actions.is_fenced(self.room)

    @property
    def resharded(self) -> bool:
        """The room's KV came from a prefill of another TP size (set once it is resolved, i.e.
        by the time the room is WaitingForInput): its digest covers other head ranges."""
        r = self._rooms.get(self.room)
        return self._resharded if r is None else r.resharded
