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
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from transfer import messages as m
from transfer import wire
from transfer.args import KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.base import BootstrapClient, DataPlane
from transfer.config import KVManagerConfig
from transfer.descriptors import index_list
from transfer.errors import TransferError
from transfer.handles import PrefillKVSender
from transfer.poll import KVPoll, can_advance
from transfer.worker import Chunk, Target, TransferWorker
from transfer.zmq_io import PushSockets, bind_pull, serve_pull

log = logging.getLogger(__name__)

# Failure statuses to a decode we stop talking to (write failure, shutdown) still get this long
# to leave: closing with linger 0 would discard them, and the decode would then wait out its
# waiting timeout per room instead of hearing why at once.
GOODBYE_FLUSH_S = 1.0


@dataclass
class _Room:
    room: int
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str | None = None
    infos: dict[str, m.TransferInfo] = field(default_factory=dict)  # by decode session
    inflight: int = 0  # chunks a worker is writing right now
    pages_queued: int = 0
    last_queued: bool = False
    failure_sent: bool = False


class PrefillKVManager:
    """Owns the control socket, the workers and (once constructed) ``engine``: ``close()`` closes it."""

    def __init__(
        self,
        args: KVArgs,
        engine: DataPlane,
        bootstrap: BootstrapClient,
        bootstrap_addr: str,
        config: KVManagerConfig = KVManagerConfig(),
    ) -> None:
        self.args, self.engine, self.config = args, engine, config
        self._bootstrap, self._bootstrap_addr = bootstrap, bootstrap_addr
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._orphans: dict[int, tuple[float, dict[str, m.TransferInfo]]] = {}  # infos before their sender
        self._tombstones: dict[int, tuple[float, str]] = {}  # room -> (expiry, reason)
        self._peers: dict[str, m.KVArgsRegister] = {}  # decode session -> its buffers
        self._rejected: dict[str, str] = {}  # decode session -> why its KV args were refused
        self._last_heard: dict[str, float] = {}  # decode session -> last message from it
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._push = PushSockets(self._ctx)
        self._pull, port = bind_pull(self._ctx, args.host)
        self.endpoint = f"tcp://{args.host}:{port}"
        # One staging aux row per worker: a worker copies the room's record there, then writes it.
        self._staging = AuxPool(config.num_workers, top_k=args.aux_top_k)
        self._threads: list[threading.Thread] = []
        try:
            staging = self._staging.buffers()
            for ptr, nbytes in [*args.all_buffers(), *zip(staging.ptrs, staging.nbytes)]:
                engine.register(ptr, nbytes)
            self._workers = [TransferWorker(i, self, engine, self._staging, config.max_batch_entries) for i in range(config.num_workers)]
            self.rank_info = wire.rank_info(args, port, self.instance_id, engine)
            bootstrap.register_rank(bootstrap_addr, self.rank_info)
        except Exception as exc:
            self._pull.close(linger=0)
            self._push.close()
            self._ctx.term()
            raise TransferError(f"prefill transfer manager failed to start: {exc}") from exc
        boot = threading.Thread(
            target=serve_pull, name="pdc-prefill-bootstrap", daemon=True,
            args=(self._pull, m.decode_to_prefill, self._handle, self._on_tick, self._stop, config.tick_s, "prefill bootstrap"),
        )
        self._threads = [boot, *(w.thread for w in self._workers)]
        for t in self._threads:
            t.start()
        log.info("prefill KV manager up: control %s, data %s", self.endpoint, engine.session_id)

    # --- scheduler-facing ----------------------------------------------------------------------
    def create_sender(self, room: int) -> PrefillKVSender:
        now = time.monotonic()
        with self._lock:
            if room in self._rooms:
                raise TransferError("room is already in flight on this prefill rank", room)
            r = self._rooms[room] = _Room(room, now)
            orphan = self._orphans.pop(room, None)
            if orphan is not None:
                for info in orphan[1].values():
                    self._add_info_locked(r, info)
            tomb = self._tombstones.pop(room, None)
            if tomb is not None:  # after the orphans: each decode that sent an info hears of it
                self._fail_locked(r, tomb[1])
        return PrefillKVSender(self, room)

    def close(self) -> None:
        """Stop threads, close sockets, release the engine (idempotent).

        Every room fails first, under the lock: workers then skip the chunks still queued
        (``begin_chunk``) and stop a chunk in progress before its next batch, so each exits
        after at most the engine call it is in. The engine is closed only once every worker has
        exited: closing it unregisters the memory an in-flight write is reading.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        try:  # so decodes stop finding this rank; its bootstrap server may already be gone
            self._bootstrap.deregister_rank(self._bootstrap_addr, self.rank_info)
        except Exception as exc:
            log.info("could not deregister from bootstrap %s: %s", self._bootstrap_addr, exc)
        with self._lock:
            for r in self._rooms.values():
                self._fail_locked(r, "prefill transfer manager shutting down")
        for w in self._workers:
            w.stop()
        # One engine call is bounded by the data plane's write timeout, which the quarantine covers.
        deadline = time.monotonic() + max(10.0, self.config.hung_peer_quarantine_s + 1.0)
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        self._push.close(flush_s=GOODBYE_FLUSH_S)
        self._ctx.term()
        if stuck:  # leak the engine rather than unregister memory under a running write
            log.error("transfer threads %s did not stop; the data plane is left open", stuck)
            return
        self.engine.close()

    def num_rooms(self) -> int:
        return len(self._rooms)

    # --- bootstrap thread ----------------------------------------------------------------------
    def _handle(self, msg: object) -> None:
        session = getattr(msg, "session_id", None)
        if session is not None:
            self._last_heard[session] = time.monotonic()
        endpoint = getattr(msg, "status_endpoint", None)
        bad = None if endpoint is None else wire.bad_endpoint(endpoint)
        if bad is not None:  # every message carries it; each answer would go there
            return self._refuse_session(msg, f"unusable status endpoint {endpoint!r}: {bad}")  # type: ignore[arg-type]
        if isinstance(msg, m.KVArgsRegister):
            self._on_register(msg)
        elif isinstance(msg, m.TransferInfo):
            self._on_info(msg)
        elif isinstance(msg, m.AbortRoom):
            self._on_abort(msg)
        elif isinstance(msg, m.Ping):
            self._push.send(msg.status_endpoint, m.Pong(seq=msg.seq, endpoint=self.endpoint, instance_id=self.instance_id))

    def _on_register(self, msg: m.KVArgsRegister) -> None:
        reason = wire.peer_mismatch(self.args, msg)
        with self._lock:
            old = self._peers.get(msg.session_id)
            if old is not None and old.instance_id != msg.instance_id:
                self._fail_session_locked(msg.session_id, "decode restarted with the same session id")
            if reason is not None:
                self._peers.pop(msg.session_id, None)
                self._rejected[msg.session_id] = reason
            else:
                self._peers[msg.session_id] = msg
                self._rejected.pop(msg.session_id, None)
        if reason is not None:
            log.error("rejecting KV args from decode %s: %s", msg.session_id, reason)
        else:
            log.info("decode %s registered (rank %d, %d KV buffers)", msg.session_id, msg.tp_rank, len(msg.kv_ptrs))

    def _refuse_session(self, msg: m.ToPrefill, reason: str) -> None:
        """A decode we cannot answer: refuse its session like a layout we cannot serve.

        Its rooms here fail (the scheduler releases them), the room a TransferInfo/AbortRoom
        names is failed or tombstoned, and none of its infos is kept, so nothing ever tries to
        reach that address again. It recovers by registering with a usable endpoint.
        """
        session = msg.session_id
        now = time.monotonic()
        log.error("refusing decode %s: %s", session, reason)
        with self._lock:
            self._rejected[session] = reason
            self._peers.pop(session, None)
            self._fail_session_locked(session, f"decode {session} refused: {reason}")
            for room, (_, infos) in list(self._orphans.items()):
                if infos.pop(session, None) is not None:
                    self._tombstones[room] = (now + self.config.bootstrap_timeout_s, reason)
                    if not infos:
                        del self._orphans[room]
            room = getattr(msg, "room", None)
            if room is not None:
                r = self._rooms.get(room)
                if r is not None:
                    self._fail_locked(r, f"decode {session} refused: {reason}")
                else:
                    self._tombstones[room] = (now + self.config.bootstrap_timeout_s, reason)

    def _on_info(self, info: m.TransferInfo) -> None:
        with self._lock:
            peer = self._peers.get(info.session_id)
            unregistered = peer is None or peer.instance_id != info.instance_id
            if unregistered:
                rejected = self._rejected.get(info.session_id)
                reason = f"prefill refused this decode's KV args: {rejected}" if rejected else "prefill has no KV args for this decode session"
                unregistered = rejected is None  # registering again would not help a rejected layout
            else:
                reason = wire.bad_destination(peer, info)
            r = self._rooms.get(info.room)
            if r is None:
                tomb = self._tombstones.get(info.room)
                if reason is None and tomb is None:  # the request has not reached this rank yet
                    _, infos = self._orphans.setdefault(info.room, (time.monotonic(), {}))
                    infos[info.session_id] = info
                    return
                if tomb is None:  # remember the failure for a sender created later
                    self._tombstones[info.room] = (time.monotonic() + self.config.bootstrap_timeout_s, reason or "")
                reason = reason or tomb[1]
            elif unregistered:
                # Nothing can be written for this session; the answer tells the decode to register again.
                self._fail_locked(r, reason or "")
            else:
                already_told = r.status is KVPoll.Failed and r.failure_sent
                r.infos[info.session_id] = info  # a failure is then reported to this decode too
                if reason is None:
                    self._add_info_locked(r, info)
                else:
                    self._fail_locked(r, reason)
                if not already_told:
                    return
                reason = r.reason
        # Nothing was or will be written for this room: answer the decode directly.
        self._push.send(info.status_endpoint, m.TransferStatus(
            room=info.room, status=int(KVPoll.Failed), prefill_rank=self.args.tp_rank, reason=reason,
            unregistered=unregistered))

    def _on_abort(self, msg: m.AbortRoom) -> None:
        reason = f"aborted by decode: {msg.reason}"
        with self._lock:
            r = self._rooms.get(msg.room)
            if r is not None:
                if r.status is KVPoll.Success:
                    return  # the decode has (or will get) our Success, which also ends its abort
                already_told = r.status is KVPoll.Failed and r.failure_sent
                if msg.session_id not in r.infos:
                    # The decode aborted before its TransferInfo arrived: still owe it an answer.
                    r.infos[msg.session_id] = wire.stub_info(msg)
                self._fail_locked(r, reason)
                if not already_told:
                    return
                reason = r.reason or reason
            else:
                self._orphans.pop(msg.room, None)
                self._tombstones[msg.room] = (time.monotonic() + self.config.bootstrap_timeout_s, reason)
        self._push.send(msg.status_endpoint, m.TransferStatus(
            room=msg.room, status=int(KVPoll.Failed), prefill_rank=self.args.tp_rank, reason=reason))

    def _on_tick(self) -> None:
        now = time.monotonic()
        timeout = self.config.bootstrap_timeout_s
        expired: list[tuple[int, m.TransferInfo]] = []
        with self._lock:
            for r in list(self._rooms.values()):
                if r.status is KVPoll.Bootstrapping and now - r.created > timeout:
                    self._fail_locked(r, f"no TransferInfo from the decode within {timeout:g}s (bootstrap timeout)")
            for room, (since, infos) in list(self._orphans.items()):
                if now - since > timeout:
                    del self._orphans[room]
                    expired.extend((room, i) for i in infos.values())
            for room, (expiry, _) in list(self._tombstones.items()):
                if now > expiry:
                    del self._tombstones[room]
            idle = self._idle_peers_locked(now)
        for peer in idle:
            log.info("forgetting decode %s: silent for %gs", peer.session_id, self.config.idle_peer_purge_s)
            self._push.purge(peer.status_endpoint)
        for room, info in expired:
            self._push.send(info.status_endpoint, m.TransferStatus(
                room=room, status=int(KVPoll.Failed), prefill_rank=self.args.tp_rank,
                reason=f"prefill rank never received request for room {room} within {timeout:g}s"))

    def _idle_peers_locked(self, now: float) -> list[m.KVArgsRegister]:
        """Drop decodes gone silent with no room bound to them (restarted or scaled away)."""
        limit = self.config.idle_peer_purge_s
        busy = {s for r in self._rooms.values() if not r.status.terminal for s in r.infos}
        idle = [p for s, p in self._peers.items() if s not in busy and now - self._last_heard.get(s, now) > limit]
        for p in idle:
            del self._peers[p.session_id]
            self._last_heard.pop(p.session_id, None)
        for s in [s for s in self._last_heard if s not in self._peers and now - self._last_heard[s] > limit]:
            del self._last_heard[s]
            self._rejected.pop(s, None)
        return idle

    # --- room state (callers hold self._lock) --------------------------------------------------
    def _add_info_locked(self, r: _Room, info: m.TransferInfo) -> None:
        r.infos[info.session_id] = info
        if len(r.infos) >= info.required_dst_info_num and can_advance(r.status, KVPoll.WaitingForInput):
            r.status = KVPoll.WaitingForInput

    def _fail_locked(self, r: _Room, reason: str) -> None:
        if not can_advance(r.status, KVPoll.Failed):
            return
        r.status, r.reason = KVPoll.Failed, reason
        log.warning("room %d failed: %s", r.room, reason)
        self._notify_failure_locked(r)

    def _notify_failure_locked(self, r: _Room) -> None:
        """Tell each decode of a failed room, once, and only when no write to it is in flight."""
        if r.status is not KVPoll.Failed or r.inflight > 0 or r.failure_sent:
            return
        r.failure_sent = True
        for info in r.infos.values():
            self._push.send(info.status_endpoint, m.TransferStatus(
                room=r.room, status=int(KVPoll.Failed), prefill_rank=self.args.tp_rank, reason=r.reason))

    def _fail_session_locked(self, session: str, reason: str) -> None:
        for r in self._rooms.values():
            if session in r.infos:
                self._fail_locked(r, reason)

    # --- sender-facing -------------------------------------------------------------------------
    def _queue_chunk(self, room: int, pages: Sequence[int], last: bool, aux: AuxRecord | None, state: Sequence[int]) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.terminal:
                return  # already failed (or finished): the chunk is moot
            if r.status is KVPoll.Bootstrapping:
                raise TransferError("send() before the room reached WaitingForInput", room)
            n_dst = min(len(i.dst_pages) for i in r.infos.values())
            end = r.pages_queued + len(pages)
            if r.last_queued:
                return self._fail_locked(r, "send() after the last chunk")
            if end > n_dst or (last and end != n_dst):
                return self._fail_locked(r, f"prefill sends {end} pages but the decode reserved {n_dst}")
            chunk = Chunk(room, index_list(pages), r.pages_queued, last, aux, index_list(state))
            r.pages_queued, r.last_queued, r.status = end, last, KVPoll.Transferring
        self._workers[room % len(self._workers)].put(chunk)

    def _abort(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                self._fail_locked(r, reason)

    def _release(self, room: int) -> None:
        """The scheduler saw a terminal state: forget the room (late messages get a tombstone)."""
        with self._lock:
            r = self._rooms.pop(room, None)
            if r is not None and r.status is KVPoll.Failed:
                self._tombstones[room] = (time.monotonic() + self.config.bootstrap_timeout_s, r.reason or "failed")

    # --- worker-facing (see transfer.worker) ---------------------------------------------------
    def begin_chunk(self, chunk: Chunk) -> list[Target] | None:
        """Pin the room for a chunk; None when it failed meanwhile (nothing to write)."""
        with self._lock:
            r = self._rooms.get(chunk.room)
            if r is None or r.status is not KVPoll.Transferring:
                return None
            targets = []
            for info in r.infos.values():
                peer = self._peers.get(info.session_id)
                if peer is None or peer.instance_id != info.instance_id:
                    self._fail_locked(r, f"decode {info.session_id} is gone")
                    return None
                targets.append(Target(info, peer))
            r.inflight += 1
            return targets

    def room_failed(self, room: int) -> bool:
        r = self._rooms.get(room)
        return r is None or r.status is KVPoll.Failed

    def end_chunk(self, chunk: Chunk, error: str | None, dead_session: str | None) -> None:
        peer = None
        with self._lock:
            r = self._rooms[chunk.room]  # pinned by begin_chunk: only _release removes it, after poll saw terminal
            r.inflight -= 1
            if error is not None:
                self._fail_locked(r, error)
            elif chunk.last and r.status is KVPoll.Transferring:
                r.status = KVPoll.Success
                for info in r.infos.values():
                    self._push.send(info.status_endpoint, m.TransferStatus(
                        room=r.room, status=int(KVPoll.Success), prefill_rank=self.args.tp_rank))
            self._notify_failure_locked(r)
            if dead_session is not None:
                peer = self._peers.pop(dead_session, None)
                self._fail_session_locked(dead_session, error or f"decode {dead_session} unreachable")
        if dead_session is not None and peer is not None:
            # Forget the peer (a restarted decode registers again under a new session), but let
            # the Failed statuses just queued for its rooms reach it: its data port failed, its
            # control port may well be alive.
            self._push.purge(peer.status_endpoint, flush_s=GOODBYE_FLUSH_S)
