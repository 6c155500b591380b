"""Decode side: ``DecodeKVManager`` (one per scheduler process) and ``DecodeKVReceiver`` (per room).

Threads (all daemons, joined by ``close()``)::

    connect thread    rooms to resolve: bootstrap lookup (cached per prefill rank), layout check,
                      KVArgsRegister once per prefill rank
    status thread     PULL <- prefill: TransferStatus | Pong
    heartbeat thread  each interval: Ping every prefill rank, declare dead after N misses,
                      probe peers the holding set waits on (transfer.decode_liveness); each
                      tick: room timers (bootstrap, waiting, fence deadlines)

Room lifecycle on this side::

    create_receiver(room, addr)   Bootstrapping     (connect thread resolves the prefill rank)
    resolved + registered         WaitingForInput   (scheduler may reserve pages, then init())
    init(): TransferInfo sent     Transferring
    TransferStatus(Success)       Success           (KV and aux row have landed; from every
                                                     source rank, then staged slices scattered)
    failure                       Failed

Fence: once TransferInfo is out, the prefill may write into the room's pages, so this side
reports Failed only when no write can land any more: the prefill said Failed (it says so only
after its in-flight writes returned), or it was declared dead and its control port refuses
connections (the process is gone). A local abort or the waiting timeout sends AbortRoom and
waits for that answer. A dead-declared rank whose port still accepts (hung, or host
unreachable) keeps its rooms' pages quarantined for ``hung_peer_quarantine_s`` first. A room
still unanswered at its fence deadline fails to its client but is *fenced* (``transfer.fenced``):
``fenced()`` stays True, and its pages must stay out of the pools, until a write is impossible.

Tensor parallelism: one manager per decode rank. A room links the rank to every prefill rank it
sends a TransferInfo to (``transfer.peers.Links``: its sources, and unused replicas it tells there
is nothing to send); the rules above hold per source: Success needs every source's Success, and a
failure (any rank's Failed, a local abort, a dead rank) aborts the others and reports Failed only
once every source answered or is proven gone. Head slices that land in the staging area
(``transfer.staging``) are copied into the room's pages before it reports Success.

Parts, composed here::

    RoomTable[DecodeRoom]    transfer.rooms: the records, the lock
    PeerCache                transfer.peers: prefill ranks looked up, routes, failed lookups
    FencedRooms              transfer.fenced: the holding set
    DecodeLiveness           transfer.decode_liveness: heartbeats, dead peers, fence probes
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from bootstrap_server.errors import LayoutMismatch
from bootstrap_server.schema import DecodeLayout

from transfer import messages as m, wire
from transfer.args import KVArgs
from transfer.base import BootstrapClient, DataPlane
from transfer.bootstrap import with_cluster_secret
from transfer.config import KVManagerConfig
from transfer.decode_liveness import DecodeLiveness
from transfer.descriptors import index_list
from transfer.errors import RoomInUse, TransferError
from transfer.fenced import Fenced, FencedRooms
from transfer.handles import DecodeKVReceiver
from transfer.manager_base import KVManagerBase
from transfer.peers import PeerCache
from transfer.poll import KVPoll
from transfer.rooms import DecodeRoom, RoomTable
from transfer.staging import StagingArea

log = logging.getLogger(__name__)


class DecodeKVManager(KVManagerBase[DecodeRoom]):
    """A decode rank's manager: the base (room table, status socket, ``engine``, which ``close()``
    closes) plus the prefill ranks it knows, its staging area, the holding set, liveness and the
    connect queue."""

    ROLE = "decode"

    def __init__(self, args: KVArgs, engine: DataPlane, bootstrap: BootstrapClient, config: KVManagerConfig) -> None:
        layout = DecodeLayout.from_kv_layout(args.layout, tp_size=args.tp_size, transfer_backend=engine.name,
                                             state=args.state_layout, total_kv_heads=args.total_kv_heads,
                                             kv_staging=args.can_stage)
        rooms: RoomTable[DecodeRoom] = RoomTable()
        self._peers = PeerCache(rooms.lock, with_cluster_secret(bootstrap, config.cluster_secret), layout, args.tp_rank)
        # Where head slices from a prefill of another TP size land (transfer.staging); a fenced
        # room keeps its staging pages until the fence lifts. Allocated before the control plane
        # opens, so a failed allocation leaves nothing open.
        self._staging = (StagingArea(args.staging_pages, args.page_unit_nbytes, args.kv_tensors[0].device)
                         if args.can_stage else None)
        self._held_staging: dict[int, list[tuple[int, int]]] = {}  # fenced room -> its staging extents
        self._fenced = FencedRooms(on_released=self._release_staging)
        # Rooms to connect, or (room, bootstrap addr, reason, only if not live here): tell a
        # prefill we could not reach yet that the room was aborted or refused, so its sender
        # fails now rather than at its timeout.
        self._todo: queue.Queue[int | tuple[int, str, str, bool] | None] = queue.Queue()
        super().__init__(args, engine, config, rooms)
        self.status_endpoint = self.endpoint  # where prefill ranks send TransferStatus and Pong
        staging_mem = [] if self._staging is None else [(self._staging.buf.data_ptr(), self._staging.buf.numel())]
        self._staging_area = staging_mem[0] if staging_mem else (0, 0)
        with self._starting():
            self._register([*args.all_buffers(), *staging_mem])
        self._liveness = DecodeLiveness(config, self._rooms, self._peers, self._fenced, self._push, engine.session_id,
                                        self.status_endpoint, self._rank_failed_locked)
        self._plane.start([
            threading.Thread(target=self._connect_loop, name="pdc-decode-connect", daemon=True),
            self._plane.server("pdc-decode-status", m.decode_to_decode, self._handle, lambda: None, config.tick_s,
                               "decode status"),
            threading.Thread(target=self._heartbeat_loop, name="pdc-decode-heartbeat", daemon=True),
        ])
        log.info("decode KV manager up: status %s, data %s", self.status_endpoint, engine.session_id)

    # --- scheduler-facing ----------------------------------------------------------------------
    def create_receiver(self, room: int, bootstrap_addr: str) -> DecodeKVReceiver:
        """``bootstrap_addr``: the prefill node's bootstrap server, "host:port"."""
        with self._lock:
            if room in self._rooms or room in self._fenced:
                raise RoomInUse("room is already in flight (or fenced) on this decode rank", room)
            self._rooms.insert_locked(DecodeRoom(room, bootstrap_addr, time.monotonic()))
        self._todo.put(room)
        return DecodeKVReceiver(self._rooms, self, room)

    def reject_room(self, room: int, bootstrap_addr: str, reason: str) -> None:
        """Tell the prefill behind ``bootstrap_addr`` that this decode refused ``room`` (a request
        turned away before it got a receiver: duplicate rid, prompt too big, ...), so the
        prefill's sender fails now instead of sitting in Bootstrapping until its timeout.
        Returns at once (lookup and AbortRoom go through the connect thread, like a late abort).
        A room that is live here belongs to another request and is left alone."""
        with self._lock:
            if room in self._rooms or self._stop.is_set():
                return
        self._todo.put((room, bootstrap_addr, reason, True))

    def _wind_down(self) -> tuple[float, float]:
        """Wake the connect thread to exit (the other threads watch ``stop``); nothing queued
        is owed to anyone, so it is discarded."""
        self._todo.put(None)
        return 10.0, 0.0

    def num_fenced(self) -> int:
        """Rooms failed to their client whose pages stay held until the peer cannot write."""
        return len(self._fenced)

    def staging_pages_in_use(self) -> int:
        """Staging pages held by rooms (live or fenced); 0 when idle or without staging."""
        with self._lock:
            return 0 if self._staging is None else self._staging.pages - self._staging.free_pages()

    # --- receiver-facing (transfer.handles.ReceiverActions) ------------------------------------
    def init_room(self, room: int, pages: Sequence[int], aux_slot: int | None, state: Sequence[int],
                  prompt_digest: str = "", decode_prefix_len: int = 0) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.terminal or r.pending_fail is not None:
                return  # failed meanwhile: the caller sees it at its next poll
            if r.status is not KVPoll.WaitingForInput or not r.resolved:
                raise TransferError(f"init() in state {r.status.name}; wait for WaitingForInput", room)
            dst_pages = index_list(pages)
            extents = None if not r.scatter or self._staging is None else self._staging.alloc(len(dst_pages))
            if r.scatter and extents is None:
                free = 0 if self._staging is None else self._staging.free_pages()
                refused = f"decode staging full: {len(dst_pages)} pages wanted, {free} free (size staging_pages to the KV pool)"
                self._fail_now_locked(r, refused)  # nothing was sent yet
            else:
                refused = None
                r.staging, r.dst_pages = extents or [], dst_pages
                sends = [(peer.endpoint, m.TransferInfo(
                    room=room, session_id=self.engine.session_id, instance_id=self.instance_id,
                    status_endpoint=self.status_endpoint, dst_pages=dst_pages,
                    aux_slot=None if aux_slot is None else int(aux_slot), state_slots=index_list(state),
                    prompt_digest=prompt_digest, required_dst_info_num=r.required[p], staging=list(r.staging),
                    decode_prefix_len=int(decode_prefix_len),
                ), p) for p, peer in r.links.items()]
                r.status, r.info_sent_at = KVPoll.Transferring, time.monotonic()
        if refused is not None:  # the prefill ranks hear it now, not at their bootstrap timeout
            return self._send_abort(r, refused)
        unsent = [(endpoint, p) for endpoint, info, p in sends if not self._push.send(endpoint, info)]
        if unsent:
            # Not queued, so never delivered: those ranks write nothing; the others are aborted.
            with self._lock:
                for endpoint, p in unsent:
                    self._rank_failed_locked(r, p, f"could not queue TransferInfo for prefill {endpoint}")
            self._send_abort(r, r.pending_fail or "could not queue TransferInfo")

    def abort_room(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.terminal or r.pending_fail is not None:
                return
            if r.info_sent_at is None:
                self._fail_now_locked(r, reason)
            else:
                self._begin_abort_locked(r, reason)
        # Also when nothing was sent yet: the prefill's sender then fails now, not at its timeout.
        if r.resolved:
            self._send_abort(r, reason)
        else:
            self._todo.put((room, r.bootstrap_addr, reason, False))

    def is_fenced(self, room: int) -> bool:
        return room in self._fenced

    # --- connect thread ------------------------------------------------------------------------
    def _connect_loop(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            if isinstance(item, tuple):
                self._late_abort(*item)
                continue
            try:
                self._connect(item)
            except Exception as exc:  # the thread outlives any one room
                log.exception("connect: room %d", item)
                self._fail(item, f"connecting to the prefill failed: {exc!r}")

    def _late_abort(self, room: int, addr: str, reason: str, only_if_absent: bool) -> None:
        if only_if_absent and room in self._rooms:
            return  # a receiver for this room appeared meanwhile: the room is live, not refused
        try:
            endpoints = [peer.endpoint for peer in self._peers.resolve(addr, room).peers.values()]
        except Exception:
            try:  # a layout we cannot receive (LayoutMismatch): tell every rank of the node
                endpoints = self._peers.node_endpoints(addr, room)
            except Exception:
                return  # unreachable: the prefill's own bootstrap timeout fails its sender
        for endpoint in endpoints:
            self._push.send(endpoint, m.AbortRoom(
                room=room, session_id=self.engine.session_id, status_endpoint=self.status_endpoint, reason=reason))

    def _connect(self, room: int) -> None:
        r = self._rooms.get(room)
        if r is None or r.status is not KVPoll.Bootstrapping:
            return
        addr = r.bootstrap_addr
        try:
            links = self._peers.resolve(addr, room)
        except Exception as exc:  # BootstrapError (unreachable, not registered, layout) or bad data
            reason = f"bootstrap {addr}: {exc}"
            with self._lock:
                self._peers.lookup_failed_locked(addr, reason, for_s=self.config.heartbeat_interval_s)
            self._fail(room, reason)
            if isinstance(exc, LayoutMismatch):  # the prefill's ranks are up and may hold the room
                self._todo.put((room, addr, reason, False))
            return
        to_register = []
        with self._lock:
            gone = [peer.endpoint for peer in links.peers.values() if self._peers.get(peer.endpoint) is not peer]
            if gone:
                self._fail_now_locked(r, f"prefill {gone[0]} was declared dead while connecting")
                return
            for peer in links.peers.values():
                if not peer.registered:
                    peer.registered = True
                    to_register.append(peer)
            r.links, r.sources, r.required = dict(links.peers), links.sources, dict(links.required)
            r.slices, r.scatter, r.resharded = links.slices, links.scatter, links.resharded
        for peer in to_register:
            msg = wire.register_message(self.args, self.engine.session_id, self.instance_id, self.status_endpoint,
                                        self._staging_area)
            if not self._push.send(peer.endpoint, msg):
                return self._fail(room, f"could not queue KV args for prefill {peer.endpoint}")
        with self._lock:
            if r.pending_fail is None:
                self._rooms.advance_locked(r, KVPoll.WaitingForInput)

    # --- status thread -------------------------------------------------------------------------
    def _handle(self, msg: object) -> None:
        if isinstance(msg, m.TransferStatus):
            self._on_status(msg)
        elif isinstance(msg, m.Pong):
            self._liveness.on_pong(msg)

    def _on_status(self, msg: m.TransferStatus) -> None:
        aborts: DecodeRoom | None = None
        scatter: DecodeRoom | None = None
        with self._lock:
            if self._fenced.release_rank(msg.room, msg.prefill_rank, f"prefill rank {msg.prefill_rank} answered for it"):
                self._rooms.changed_locked()
                return
            r = self._rooms.get(msg.room)
            if r is None or r.status.terminal or msg.prefill_rank not in r.links:
                log.debug("status for unknown or finished room %d (rank %d) dropped", msg.room, msg.prefill_rank)
                return
            if msg.unregistered:
                r.links[msg.prefill_rank].registered = False  # the next room registers again
            if r.info_sent_at is None:  # nothing was sent: nothing can be written
                self._fail_now_locked(r, f"prefill rank {msg.prefill_rank}: {msg.reason or 'failed'}")
            elif msg.status == KVPoll.Success:
                r.answered.setdefault(msg.prefill_rank, True)
                scatter = self._settle_locked(r)
            else:
                started = r.pending_fail is None
                self._rank_failed_locked(r, msg.prefill_rank, f"prefill rank {msg.prefill_rank}: {msg.reason or 'failed'}")
                if started and not r.status.terminal:
                    aborts = r
        if aborts is not None:
            self._send_abort(aborts, aborts.pending_fail or "failed")
        if scatter is not None:
            self._scatter(scatter)

    def _scatter(self, r: DecodeRoom) -> None:
        """Copy a room's staged slices into its pages, outside the lock (a memcpy of the room's
        KV on CPU must not stall the scheduler's calls), then finish it. Every source has
        answered, so nothing else writes the staging pages; ``scattering`` keeps every other
        path from releasing them meanwhile (a failure decided now is applied after the copy)."""
        assert self._staging is not None
        error = None
        try:
            self._staging.scatter(self.args, r.slices, r.dst_pages, r.staging)
        except Exception as exc:
            log.exception("room %d: scatter from staging failed", r.room)
            error = f"scatter from staging failed: {exc!r}"
        with self._lock:
            r.scattering = False
            if error is not None or r.pending_fail is not None:
                self._fail_now_locked(r, error or r.pending_fail or "failed")
            elif self._rooms.advance_locked(r, KVPoll.Success):
                self._drop_staging_locked(r)

    # --- heartbeat thread ----------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.wait(self.config.tick_s):
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval_s
                    self._liveness.beat()
                self._timers(time.monotonic())
            except Exception:
                log.exception("heartbeat pass failed")

    def _timers(self, now: float) -> None:
        cfg = self.config
        aborts: list[tuple[DecodeRoom, str]] = []
        with self._lock:
            self._peers.expire_failures_locked(now)
            for r in self._rooms.records_locked():
                if r.status.terminal:
                    continue
                if r.pending_fail is not None:
                    if now >= r.fence_deadline and not r.scattering:
                        log.error("room %d: no answer from prefill ranks %s by the fence deadline; failing it", r.room,
                                  r.silent_sources())
                        # no proof the silent ranks' writes ended: hold the pages (and staging)
                        for p in r.silent_sources():
                            i = r.links[p].info
                            self._fenced.hold(Fenced(r.room, i.endpoint, i.rank_ip, i.rank_port, i.instance_id, now, p))
                        self._fail_now_locked(r, r.pending_fail)
                elif r.info_sent_at is None and now - r.created > cfg.bootstrap_timeout_s:
                    what = "reach the prefill" if r.status is KVPoll.Bootstrapping else "reserve memory"
                    reason = f"could not {what} within {cfg.bootstrap_timeout_s:g}s (bootstrap timeout)"
                    self._fail_now_locked(r, reason)
                elif r.info_sent_at is not None and now - r.info_sent_at > cfg.waiting_timeout_s:
                    reason = f"KV did not arrive within {cfg.waiting_timeout_s:g}s (waiting timeout)"
                    aborts.append((r, self._begin_abort_locked(r, reason)))
        for r, reason in aborts:
            self._send_abort(r, reason)

    # --- room state (lock held where named so) -------------------------------------------------
    def _fail(self, room: int, reason: str) -> None:
        """Fail a room that has not sent its TransferInfo (nothing can be written into it)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.info_sent_at is None:
                self._fail_now_locked(r, reason)

    def _fail_now_locked(self, r: DecodeRoom, reason: str) -> None:
        """Failed, now: no write can land (nothing was sent, or every source answered or is
        gone), or the silent ones were just fenced. Staging pages go back unless fenced. During
        a scatter the failure waits for its end (``_scatter`` applies it)."""
        if r.scattering:
            r.pending_fail = r.pending_fail or reason
            return
        if self._rooms.advance_locked(r, KVPoll.Failed, reason):
            self._drop_staging_locked(r)

    def _drop_staging_locked(self, r: DecodeRoom) -> None:
        extents, r.staging = r.staging, []
        if not extents or self._staging is None:
            return
        if r.room in self._fenced:
            self._held_staging[r.room] = extents  # a silent source may still write there
        else:
            self._staging.free(extents)

    def _release_staging(self, room: int) -> None:
        """The holding set lifted ``room``'s fence (lock held): its staging pages are free."""
        extents = self._held_staging.pop(room, None)
        if extents and self._staging is not None:
            self._staging.free(extents)

    def _rank_failed_locked(self, r: DecodeRoom, rank: int, reason: str) -> None:
        """Prefill rank ``rank`` failed the room, or is proven unable to write: the room fails
        (the caller sends the AbortRooms), once no source can still write."""
        if r.status.terminal:
            return
        r.answered[rank] = False
        if r.pending_fail is None:
            self._begin_abort_locked(r, reason)
        self._settle_locked(r)

    def _settle_locked(self, r: DecodeRoom) -> DecodeRoom | None:
        """Finish the room if its sources allow: all answered after a failure -> Failed; all said
        Success -> Success, or, when slices wait in staging, the room to scatter first (returned,
        marked ``scattering``: the caller runs ``_scatter`` outside the lock)."""
        if r.status.terminal or r.scattering or r.silent_sources():
            return None
        if r.pending_fail is not None or not all(r.answered[p] for p in r.sources):
            self._fail_now_locked(r, r.pending_fail or "a prefill rank failed")
            return None
        if r.staging:
            r.scattering = True
            return r
        if self._rooms.advance_locked(r, KVPoll.Success):
            self._drop_staging_locked(r)
        return None

    def _begin_abort_locked(self, r: DecodeRoom, reason: str) -> str:
        r.pending_fail = reason
        r.fence_deadline = time.monotonic() + self.config.heartbeat_bound_s + self.config.hung_peer_quarantine_s
        return reason

    def _send_abort(self, r: DecodeRoom, reason: str) -> None:
        """AbortRoom to every linked rank that has not answered (each answers Failed once its own
        writes for the room returned)."""
        for peer in r.unanswered():
            if peer.endpoint in self._peers:  # a rank declared dead is not asked again
                self._push.send(peer.endpoint, m.AbortRoom(
                    room=r.room, session_id=self.engine.session_id, status_endpoint=self.status_endpoint, reason=reason))
