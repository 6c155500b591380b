"""Prefill side: ``PrefillKVManager`` (one per scheduler process) and ``PrefillKVSender`` (per room).

Threads (all daemons, joined by ``close()``)::

    bootstrap thread   PULL <- decode: KVArgsRegister | TransferInfo | AbortRoom | Ping
                       + timers: Bootstrapping rooms, orphan TransferInfos, tombstones
    transfer workers   queue <- send() chunks; room r always goes to worker r % N (chunk order)

Room lifecycle on this side::

    create_sender(room)       Bootstrapping
    TransferInfo(s) arrive    WaitingForInput    (may arrive before the sender exists: kept)
    send(first chunk)         Transferring
    last chunk written        Success   -> TransferStatus(Success) to the decode
    any failure               Failed    -> TransferStatus(Failed) to the decode, sent (and shown
                                           by poll) only once no write for the room is in flight

Fence: a worker checks the room before every engine batch, and ``poll()`` keeps a failed room
at Transferring while a batch is in flight, so the decode frees its pages, and we ours, only
after our last write to them returned.

Parts, composed here::

    RoomTable[PrefillRoom]   transfer.rooms: the records, the lock, tombstones
    PrefillControl           transfer.prefill_control: the bootstrap thread's handlers and timers,
                             the decodes it knows, the statuses they are owed
    TransferWorker x N       transfer.worker: they call back ``begin_chunk``/``end_chunk`` below
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from transfer import messages as m
from transfer import wire
from transfer.args import KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.base import BootstrapClient, DataPlane
from transfer.bootstrap import with_cluster_secret
from transfer.config import KVManagerConfig
from transfer.descriptors import index_list
from transfer.errors import RoomInUse, TransferError
from transfer.handles import PrefillKVSender
from transfer.manager_base import KVManagerBase
from transfer.poll import KVPoll
from transfer.prefill_control import PrefillControl
from transfer.rooms import PrefillRoom, RoomTable
from transfer.staging import Arena
from transfer.worker import GROUP_MAX, Chunk, Target, TransferWorker

log = logging.getLogger(__name__)

# Failure statuses to a decode we stop talking to (write failure, shutdown) still get this long
# to leave: closing with linger 0 would discard them, and the decode would then wait out its
# waiting timeout per room instead of hearing why at once.
GOODBYE_FLUSH_S = 1.0


class PrefillKVManager(KVManagerBase[PrefillRoom]):
    """A prefill rank's manager: the base (room table, control socket, ``engine``, which
    ``close()`` closes) plus the bootstrap thread's handlers, the transfer workers with their
    staging, and the rank's entry in its node's bootstrap registry."""

    ROLE = "prefill"

    def __init__(self, args: KVArgs, engine: DataPlane, bootstrap: BootstrapClient, bootstrap_addr: str,
                 config: KVManagerConfig) -> None:
        self._bootstrap = bootstrap = with_cluster_secret(bootstrap, config.cluster_secret)
        self._bootstrap_addr = bootstrap_addr
        # GROUP_MAX staging aux rows per worker: a worker copies each last chunk's record to its
        # own row of the group being written, then writes it with the chunk's pages.
        self._staging = AuxPool(config.num_workers * GROUP_MAX, top_k=args.aux_top_k)
        # One staging arena per worker, where head slices for a decode of another TP size are
        # gathered (transfer.staging); none when the rank cannot stage (equal TP only).
        # Allocated before the control plane opens, so a failed allocation leaves nothing open.
        self._arenas = [Arena(args.staging_pages * args.page_unit_nbytes, args.kv_tensors[0].device)
                        for _ in range(config.num_workers)] if args.can_stage else []
        super().__init__(args, engine, config, RoomTable(tombstone_s=config.bootstrap_timeout_s))
        self._control = PrefillControl(self._rooms, self._push, args, config, self.endpoint, self.instance_id)
        with self._starting():
            staging = self._staging.buffers()
            arenas = [(a.ptr, a.nbytes) for a in self._arenas]
            self._register([*args.all_buffers(), *zip(staging.ptrs, staging.nbytes), *arenas])
            self._workers = [TransferWorker(i, self, args, engine, self._staging, config.max_batch_entries,
                                            self._arenas[i] if self._arenas else None)
                             for i in range(config.num_workers)]
            self.rank_info = wire.rank_info(args, self._plane.port, self.instance_id, engine)
            bootstrap.register_rank(bootstrap_addr, self.rank_info)
        boot = self._plane.server("pdc-prefill-bootstrap", m.decode_to_prefill, self._control.handle, self._control.tick,
                                  config.tick_s, "prefill bootstrap")
        self._plane.start([boot, *(w.thread for w in self._workers)])
        log.info("prefill KV manager up: control %s, data %s", self.endpoint, engine.session_id)

    # --- scheduler-facing ----------------------------------------------------------------------
    def create_sender(self, room: int, prompt_digest: str = "") -> PrefillKVSender:
        """``prompt_digest`` (``messages.prompt_digest`` of the prompt): a TransferInfo for this
        room from a decode that holds it for another prompt is refused, never written to."""
        with self._lock:
            if room in self._rooms:
                self._control.refused_sender_locked(room, prompt_digest)
                raise RoomInUse("room is already in flight on this prefill rank", room)
            r = self._rooms.insert_locked(PrefillRoom(room, time.monotonic(), prompt_digest=prompt_digest))
            self._control.adopt_locked(r)  # TransferInfos that came first; a failure decided already
        return PrefillKVSender(self._rooms, self, room)

    def _wind_down(self) -> tuple[float, float]:
        """Deregister, then fail every room, under the lock: workers then skip the chunks still
        queued (``begin_chunk``) and stop a chunk in progress before its next batch, so each
        exits after at most the engine call it is in. The failure statuses owed to decodes get
        ``GOODBYE_FLUSH_S`` to leave."""
        try:  # so decodes stop finding this rank; its bootstrap server may already be gone
            self._bootstrap.deregister_rank(self._bootstrap_addr, self.rank_info)
        except Exception as exc:
            log.info("could not deregister from bootstrap %s: %s", self._bootstrap_addr, exc)
        with self._lock:
            for r in self._rooms.records_locked():
                self._control.fail_locked(r, "prefill transfer manager shutting down")
        for w in self._workers:
            w.stop()
        # One engine call is bounded by the data plane's write timeout, which the quarantine covers.
        return max(10.0, self.config.hung_peer_quarantine_s + 1.0), GOODBYE_FLUSH_S

    def descriptors_written(self) -> int:
        """Descriptors the workers handed to the engine so far (observability and tests)."""
        return sum(w.descriptors_written for w in self._workers)

    def transfer_stats(self) -> dict[str, int]:
        """Counters for metrics: descriptors and bytes written so far, and the staging arenas'
        size and high-water mark (bytes, all workers; 0 without staging)."""
        return {"descriptors": self.descriptors_written(), "bytes": sum(w.bytes_written for w in self._workers),
                "staging_bytes": sum(a.nbytes for a in self._arenas),
                "staging_peak_bytes": max((a.peak for a in self._arenas), default=0)}

    def tables(self) -> dict[str, list[Any]]:
        """The keys of everything this manager holds (rooms, tombstones, orphan TransferInfos,
        known, refused and recently heard decode sessions): empty lists when it is idle."""
        with self._lock:
            return {"rooms": self._rooms.ids_locked(), "tombstones": self._rooms.tombstoned_locked(),
                    **self._control.tables_locked()}

    # --- sender-facing (transfer.handles.SenderActions) ----------------------------------------
    def queue_chunk(self, room: int, pages: Sequence[int], last: bool, aux: AuxRecord | None, state: Sequence[int]) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.terminal:
                return  # already failed (or finished): the chunk is moot
            if r.status is KVPoll.Bootstrapping:
                raise TransferError("send() before the room reached WaitingForInput", room)
            n_dst = min(len(i.dst_pages) for i in r.infos.values())
            end = r.pages_queued + len(pages)
            if r.last_queued:
                return self._control.fail_locked(r, "send() after the last chunk")
            if end > n_dst or (last and end != n_dst):
                return self._control.fail_locked(r, f"prefill sends {end} pages but the decode reserved {n_dst}")
            chunk = Chunk(room, index_list(pages), r.pages_queued, last, aux, index_list(state))
            r.pages_queued, r.last_queued, r.status = end, last, KVPoll.Transferring
        self._workers[room % len(self._workers)].put(chunk)

    def abort_room(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                self._control.fail_locked(r, reason)

    # --- worker-facing (transfer.worker.ChunkSource) -------------------------------------------
    def begin_chunk(self, chunk: Chunk) -> list[Target] | None:
        """Pin the room for a chunk; None when it failed meanwhile (nothing to write)."""
        with self._lock:
            r = self._rooms.get(chunk.room)
            if r is None or r.status is not KVPoll.Transferring:
                return None
            targets = []
            for info in r.infos.values():
                peer = self._control.peer_locked(info.session_id)
                route = self._control.route_locked(info.session_id)
                if peer is None or route is None or peer.instance_id != info.instance_id:
                    self._control.fail_locked(r, f"decode {info.session_id} is gone")
                    return None
                targets.append(Target(info, peer, route))
            r.inflight += 1
            return targets

    def room_failed(self, room: int) -> bool:
        r = self._rooms.get(room)
        return r is None or r.status is KVPoll.Failed

    def end_chunk(self, chunk: Chunk, error: str | None, dead_session: str | None) -> None:
        peer = None
        with self._lock:
            r = self._rooms[chunk.room]  # pinned by begin_chunk: released only after poll saw terminal
            r.inflight -= 1
            if error is not None:
                self._control.fail_locked(r, error)
            elif chunk.last and r.status is KVPoll.Transferring:
                self._control.succeed_locked(r)
            self._control.notify_failure_locked(r)
            self._rooms.changed_locked()  # Success, Failed, or a fenced room's last write returned
            if dead_session is not None:
                peer = self._control.forget_peer_locked(dead_session)
                self._control.fail_session_locked(dead_session, error or f"decode {dead_session} unreachable")
        if dead_session is not None and peer is not None:
            # Forget the peer (a restarted decode registers again under a new session), but let
            # the Failed statuses just queued for its rooms reach it: its data port failed, its
            # control port may well be alive.
            self._push.purge(peer.status_endpoint, flush_s=GOODBYE_FLUSH_S)
