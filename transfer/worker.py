"""Prefill transfer workers: chunks in, engine writes out.

Each worker owns a queue and ``GROUP_MAX`` staging aux rows. It takes every chunk queued at
that moment (up to ``GROUP_MAX``) as one group: it asks its ``ChunkSource`` (the prefill
manager) to pin each room (``begin_chunk``), turns each chunk's pages into merged descriptors per decode target, appends
the aux row and state items on a last chunk, and writes all of a decode's descriptors together
in batches of at most ``max_batch_entries`` (checking before each batch that none of its rooms
was failed meanwhile; a failed room's descriptors are dropped from the rest). Then it reports
each chunk back (``end_chunk``). A failed engine write means the decode peer is unreachable:
the manager fails every room bound to that peer and forgets it.

Why groups: one prefill forward finishes many requests at once. Written one engine call each,
the last of them waited for every earlier round trip (measured under load on 2 cores: 40 ms
mean queue wait before the write, against 1.5 ms p50 for the write itself). One call per decode
carries them all in one round trip.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common import envs
from transfer import descriptors as d
from transfer import messages as m
from transfer.staging import Arena, Route, slice_descriptors
from transfer.args import KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.base import DataPlane

log = logging.getLogger(__name__)

GROUP_MAX = 32  # chunks one worker writes together (one staging aux row each)


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
    """One decode rank a chunk goes to: where (info), whose buffers (peer), which heads (route)."""

    info: m.TransferInfo
    peer: m.KVArgsRegister
    route: Route


class ChunkSource(Protocol):
    """What a worker asks of the rooms its chunks belong to (the prefill manager answers)."""

    def begin_chunk(self, chunk: Chunk) -> list[Target] | None:
        """Pin the chunk's room and return where it goes; None when the room failed meanwhile
        (nothing to write, nothing pinned)."""

    def room_failed(self, room: int) -> bool:
        """Checked before every engine call: a failed room's descriptors are left out."""

    def end_chunk(self, chunk: Chunk, error: str | None, dead_session: str | None) -> None:
        """Unpin a chunk ``begin_chunk`` pinned: written (``error`` None) or failed;
        ``dead_session``: the decode a failed engine write showed unreachable."""


class TransferWorker:
    def __init__(self, index: int, source: ChunkSource, args: KVArgs, engine: DataPlane, staging: AuxPool,
                 max_batch_entries: int, arena: Arena | None = None) -> None:
        self.index = index
        self._source, self._args, self._engine, self._staging = source, args, engine, staging
        self._arena = arena  # head slices are gathered here (transfer.staging); None: equal TP only
        self._max = min(max_batch_entries, engine.max_batch_entries)
        self._queue: queue.Queue[Chunk | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"pdc-transfer-worker-{index}", daemon=True)
        #: Descriptors and bytes this worker handed to the engine (observability and tests).
        self.descriptors_written = 0
        self.bytes_written = 0
        stop_rank = envs.FAULT_STOP_RANK.get()  # fault injection; -1: off
        self._stop_room = envs.FAULT_STOP_BEFORE_WRITE_ROOM.get() if stop_rank in (-1, args.tp_rank) else -1
        # Writes of that room to let through first: with one descriptor per engine call, a test
        # stops the prefill mid-room, some pages landed on the decode and the aux row not yet.
        self._stop_after = envs.FAULT_STOP_AFTER_WRITES.get()

    def put(self, chunk: Chunk) -> None:
        self._queue.put(chunk)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            group, stop = self._take()
            if group:
                try:
                    self._process(group)
                except Exception:  # never let one group kill the worker
                    log.exception("transfer worker %d: unexpected error on rooms %s", self.index,
                                  [c.room for c in group])
            if stop:
                return

    def _take(self) -> tuple[list[Chunk], bool]:
        """The next chunk (waiting for it) and every chunk queued behind it, up to GROUP_MAX;
        True once the stop sentinel was taken."""
        first = self._queue.get()
        if first is None:
            return [], True
        group = [first]
        while len(group) < GROUP_MAX:
            try:
                chunk = self._queue.get_nowait()
            except queue.Empty:
                break
            if chunk is None:
                return group, True
            group.append(chunk)
        return group, False

    def _process(self, group: list[Chunk]) -> None:
        pinned: list[Chunk] = []
        errors: dict[int, tuple[str, str | None]] = {}  # room -> (error, dead decode session)
        per_session: dict[str, list[tuple[int, d.Descriptors]]] = {}

        def flush() -> None:
            """Write everything collected so far; the arena bytes it read are free again after."""
            for session, items in per_session.items():
                self._write(session, items, errors)
            per_session.clear()
            if self._arena is not None:
                self._arena.reset()

        def reserve(nbytes: int) -> int:
            assert self._arena is not None
            if not self._arena.fits(nbytes):
                flush()
            return self._arena.take(nbytes)

        try:
            for chunk in group:
                targets = self._source.begin_chunk(chunk)
                if targets is None:
                    continue  # failed meanwhile: nothing to write, nothing pinned
                pinned.append(chunk)
                try:
                    for t in targets:
                        def emit(desc: d.Descriptors, room: int = chunk.room, session: str = t.info.session_id) -> None:
                            if len(desc):
                                per_session.setdefault(session, []).append((room, desc))

                        self._descriptors(chunk, t, self.index * GROUP_MAX + len(pinned) - 1, reserve, emit)
                except Exception as exc:
                    errors[chunk.room] = (f"transfer worker error: {exc!r}", None)
            flush()
        except Exception as exc:
            for chunk in pinned:
                errors.setdefault(chunk.room, (f"transfer worker error: {exc!r}", None))
        finally:
            for chunk in pinned:
                error, dead = errors.get(chunk.room, (None, None))
                self._source.end_chunk(chunk, error, dead)

    def _write(self, session: str, items: list[tuple[int, d.Descriptors]],
               errors: dict[int, tuple[str, str | None]]) -> None:
        """Every room's descriptors to one decode, in batches of at most ``self._max``."""
        pieces = [(room, piece) for room, desc in items for piece in d.split(desc, self._max)]
        while pieces:
            # Before every engine call: drop the rooms that failed meanwhile (their pages may be
            # reused on the decode once the fence lets go) and the ones that already errored.
            pieces = [(room, p) for room, p in pieces if room not in errors and not self._source.room_failed(room)]
            batch, rooms, n = [], set(), 0
            while pieces and n + len(pieces[0][1]) <= self._max:
                room, piece = pieces.pop(0)
                batch.append(piece)
                rooms.add(room)
                n += len(piece)
            if not batch:
                return
            if self._stop_room in rooms and self._stop_after > 0:
                self._stop_after -= 1
            elif self._stop_room in rooms:
                log.warning("fault injection: stopping this process before writing room %d", self._stop_room)
                self._stop_room = -1  # once: the test resumes us with SIGCONT
                # At this thread, not the process: a process-directed SIGSTOP is taken by the main
                # thread when it next runs, and until then this thread went on and wrote the room.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            desc = d.concat(batch)
            if not self._engine.write(session, desc):
                error = f"decode {session} unreachable: write of {len(desc)} descriptors failed"
                for room in rooms | {room for room, _ in pieces}:
                    errors[room] = (error, session)
                return
            self.descriptors_written += len(desc)
            self.bytes_written += sum(desc.lens)

    def _descriptors(self, chunk: Chunk, t: Target, staging_row: int, reserve: Callable[[int], int],
                     emit: Callable[[d.Descriptors], None]) -> None:
        """Hand the chunk's descriptors for one decode rank to ``emit``: its head slices (none for
        a decode rank that only told an unused replica of the room), then, on the last chunk and
        only from the rank that owns them, the aux row and state."""
        args, r = self._args, t.route
        n = len(chunk.src_pages)
        if r.slices and r.direct:
            dst_pages = t.info.dst_pages[chunk.dst_offset: chunk.dst_offset + n]
            emit(d.build(chunk.src_pages, dst_pages, args.kv.ptrs, t.peer.kv_ptrs, args.kv.item_nbytes))
        elif r.slices:
            slice_descriptors(args, r, chunk.src_pages, chunk.dst_offset, t.info, t.peer, self._arena, reserve,
                                      emit)
        if not chunk.last or not r.writes_aux:
            return
        if chunk.aux is not None and t.info.aux_slot is not None and len(args.aux):
            # The record goes through this worker's staging row, stamped with the room so the
            # decode can tell it from a previous owner's row.
            self._staging.write(staging_row, dataclasses.replace(chunk.aux, room=chunk.room))
            rows = self._staging.buffers()
            emit(d.build([staging_row], [t.info.aux_slot], rows.ptrs, t.peer.aux_ptrs[:1], rows.item_nbytes))
        if len(args.state) and chunk.src_state:
            emit(self._state_descriptors(chunk.src_state, t.info.state_slots, t))

    def _state_descriptors(self, src: Sequence[int], dst: Sequence[int], t: Target) -> d.Descriptors:
        """State items (SWA window pages, Mamba states): same run merging, per state buffer."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} state items on the prefill vs {len(dst)} on the decode")
        st = self._args.state
        return d.build(src, dst, st.ptrs, t.peer.state_ptrs, st.item_nbytes)
