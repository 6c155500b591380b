"""Prefill transfer workers: chunks in, engine writes out.

Each worker owns a queue and one staging aux row. For a chunk it asks the manager to pin the
room (``begin_chunk``), turns the chunk's pages into merged descriptors per decode target,
appends the aux row and state items on the last chunk, writes them in batches of at most
``max_batch_entries`` (checking before each batch that the room was not failed meanwhile) and
reports back (``end_chunk``). A failed engine write means the decode peer is unreachable: the
manager fails every room bound to that peer and forgets it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import envs
from transfer import descriptors as d
from transfer import messages as m
from transfer.aux import AuxPool, AuxRecord
from transfer.base import DataPlane

if TYPE_CHECKING:
    from transfer.prefill import PrefillKVManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    room: int
    src_pages: list[int]
    dst_offset: int  # index into the decode's dst_pages of this chunk's first page
    last: bool
    aux: AuxRecord | None
    src_state: list[int]


@dataclass(frozen=True)
class Target:
    """One decode rank a chunk goes to: where (info) and whose buffers (peer)."""

    info: m.TransferInfo
    peer: m.KVArgsRegister


class TransferWorker:
    def __init__(self, index: int, mgr: PrefillKVManager, engine: DataPlane, staging: AuxPool, max_batch_entries: int) -> None:
        self.index = index
        self._mgr, self._engine, self._staging = mgr, engine, staging
        self._max = min(max_batch_entries, engine.max_batch_entries)
        self._queue: queue.Queue[Chunk | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"pdc-transfer-worker-{index}", daemon=True)
        #: Descriptors this worker handed to the engine (observability and tests).
        self.descriptors_written = 0
        self._stop_room = envs.FAULT_STOP_BEFORE_WRITE_ROOM.get()  # fault injection; -1: off

    def put(self, chunk: Chunk) -> None:
        self._queue.put(chunk)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            try:
                self._process(chunk)
            except Exception:  # never let one chunk kill the worker
                log.exception("transfer worker %d: unexpected error on room %d", self.index, chunk.room)

    def _process(self, chunk: Chunk) -> None:
        targets = self._mgr.begin_chunk(chunk)
        if targets is None:
            return
        error: str | None = None
        dead: str | None = None
        try:
            for t in targets:
                desc = self._descriptors(chunk, t)
                for batch in d.split(desc, self._max):
                    if self._mgr.room_failed(chunk.room):
                        return  # end_chunk in finally; the room's failure is already recorded
                    if chunk.room == self._stop_room:
                        self._stop_room = -1  # once: the test resumes us with SIGCONT
                        log.warning("fault injection: stopping this process before writing room %d", chunk.room)
                        os.kill(os.getpid(), signal.SIGSTOP)
                    if not self._engine.write(t.info.session_id, batch):
                        dead = t.info.session_id
                        error = f"decode {dead} unreachable: write of {len(batch)} descriptors failed"
                        return
                    self.descriptors_written += len(batch)
        except Exception as exc:
            error = f"transfer worker error: {exc!r}"
        finally:
            self._mgr.end_chunk(chunk, error, dead)

    def _descriptors(self, chunk: Chunk, t: Target) -> d.Descriptors:
        args = self._mgr.args
        n = len(chunk.src_pages)
        dst_pages = t.info.dst_pages[chunk.dst_offset: chunk.dst_offset + n]
        desc = d.build(chunk.src_pages, dst_pages, args.kv.ptrs, t.peer.kv_ptrs, args.kv.item_nbytes)
        if not chunk.last:
            return desc
        if chunk.aux is not None and t.info.aux_slot is not None and len(args.aux):
            # The record goes through this worker's staging row, stamped with the room so the
            # decode can tell it from a previous owner's row.
            self._staging.write(self.index, dataclasses.replace(chunk.aux, room=chunk.room))
            staging = self._staging.buffers()
            desc = desc + d.build([self.index], [t.info.aux_slot], staging.ptrs, t.peer.aux_ptrs[:1], staging.item_nbytes)
        if len(args.state) and chunk.src_state:
            desc = desc + self._state_descriptors(chunk.src_state, t.info.state_slots, t)
        return desc

    def _state_descriptors(self, src: Sequence[int], dst: Sequence[int], t: Target) -> d.Descriptors:
        """State items (SWA window pages, Mamba states): same run merging, per state buffer."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} state items on the prefill vs {len(dst)} on the decode")
        st = self._mgr.args.state
        return d.build(src, dst, st.ptrs, t.peer.state_ptrs, st.item_nbytes)
