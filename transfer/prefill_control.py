"""The prefill manager's control plane: what its bootstrap thread does with each decode message
(KVArgsRegister, TransferInfo, AbortRoom, Ping) and on each timer pass, the decodes it knows,
and the room changes that a decode must hear of (a failure, a Success).

``PrefillControl`` is composed into ``PrefillKVManager`` (``transfer.prefill``), which owns the
room table, the sockets and the threads and hands this part the table and the PUSH sockets.

Everything here runs under the table's lock where it touches the tables (``*_locked``: the
caller holds it). Answers to a decode go through ``PushSockets.send``, which never raises, so a
state change is never left half done.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from transfer import messages as m
from transfer import wire
from transfer.args import KVArgs
from transfer.config import KVManagerConfig
from transfer.poll import KVPoll
from transfer.rooms import PrefillRoom, RoomTable
from transfer.staging import Route
from transfer.zmq_io import PushSockets

log = logging.getLogger(__name__)


class PrefillControl:
    """``endpoint``: our control endpoint, named in every Pong; ``instance_id``: this process."""

    def __init__(self, rooms: RoomTable[PrefillRoom], push: PushSockets, args: KVArgs, config: KVManagerConfig,
                 endpoint: str, instance_id: str) -> None:
        self._rooms, self._push = rooms, push
        self._rank, self._args, self._config = args.tp_rank, args, config
        self._endpoint, self._instance_id = endpoint, instance_id
        self._lock = rooms.lock
        self._orphans: dict[int, tuple[float, dict[str, m.TransferInfo]]] = {}  # infos before their sender
        self._peers: dict[str, m.KVArgsRegister] = {}  # decode session -> its buffers
        self._routes: dict[str, Route] = {}  # decode session -> what we write into it (same keys)
        self._rejected: dict[str, str] = {}  # decode session -> why its KV args were refused
        self._last_heard: dict[str, float] = {}  # decode session -> last message from it
        # Halves of a shared room refused here, by (room, prompt digest) -> since when. The other
        # half of such a pair can never be served: a sender whose decode was refused would wait
        # out the bootstrap timeout for a TransferInfo that never comes (and a decode whose
        # sender got 409, the orphan expiry), so it fails as soon as it shows up.
        self._refused_infos: dict[tuple[int, str], float] = {}
        self._refused_senders: dict[tuple[int, str], float] = {}

    # --- what the manager asks (lock held) -----------------------------------------------------
    def adopt_locked(self, r: PrefillRoom) -> None:
        """A room just created here: the TransferInfos that came before it count now, and a
        failure decided before it existed fails it (after the infos: each decode hears of it)."""
        orphan = self._orphans.pop(r.room, None)
        if orphan is not None:
            for info in orphan[1].values():
                refused = self._binding_refusal_locked(r, info)
                if refused is None:
                    self._add_info_locked(r, info)
                else:
                    self._remember_refused_locked(self._refused_infos, info.room, info.prompt_digest)
                    self._push.send(info.status_endpoint, m.TransferStatus(
                        room=r.room, status=int(KVPoll.Failed), prefill_rank=self._rank, reason=refused))
        reason = self._rooms.take_tombstone_locked(r.room)
        if reason is None and r.prompt_digest and self._refused_infos.pop((r.room, r.prompt_digest), None) is not None:
            reason = (f"room {r.room}: the decode of this request was refused here before it arrived (the room "
                      "was another request's): rooms must be unique per request")
        if reason is not None:
            self.fail_locked(r, reason)

    def refused_sender_locked(self, room: int, prompt_digest: str) -> None:
        """The manager refused a sender for a live ``room`` (409): a TransferInfo for the same
        room and prompt that arrives later is that request's decode, and fails at once."""
        self._remember_refused_locked(self._refused_senders, room, prompt_digest)

    def _remember_refused_locked(self, table: dict[tuple[int, str], float], room: int, prompt_digest: str) -> None:
        if prompt_digest:  # without a digest the pair cannot be told from another: the timeouts decide
            table[(room, prompt_digest)] = time.monotonic()

    def peer_locked(self, session: str) -> m.KVArgsRegister | None:
        """The KV args a decode session registered (None: unknown, refused or forgotten)."""
        return self._peers.get(session)

    def route_locked(self, session: str) -> Route | None:
        """What we write into a registered decode session (``transfer.staging``)."""
        return self._routes.get(session)

    def forget_peer_locked(self, session: str) -> m.KVArgsRegister | None:
        """A write to ``session`` failed: it registers again (or, restarted, under a new session)."""
        self._routes.pop(session, None)
        return self._peers.pop(session, None)

    def tables_locked(self) -> dict[str, list[Any]]:
        """What this part holds, for ``PrefillKVManager.tables``."""
        return {"orphans": sorted(self._orphans), "decodes": sorted(self._peers),
                "refused": sorted({room for room, _ in (*self._refused_infos, *self._refused_senders)}),
                "rejected": sorted(self._rejected), "heard": sorted(self._last_heard)}

    # --- bootstrap thread ----------------------------------------------------------------------
    def handle(self, msg: object) -> None:
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
            self._push.send(msg.status_endpoint, m.Pong(seq=msg.seq, endpoint=self._endpoint, instance_id=self._instance_id))

    def _on_register(self, msg: m.KVArgsRegister) -> None:
        route = wire.peer_route(self._args, msg)  # a Route, or why we cannot serve this decode rank
        with self._lock:
            old = self._peers.get(msg.session_id)
            if old is not None and old.instance_id != msg.instance_id:
                self.fail_session_locked(msg.session_id, "decode restarted with the same session id")
            if isinstance(route, str):
                self.forget_peer_locked(msg.session_id)
                self._rejected[msg.session_id] = route
            else:
                self._peers[msg.session_id] = msg
                self._routes[msg.session_id] = route
                self._rejected.pop(msg.session_id, None)
        if isinstance(route, str):
            log.error("rejecting KV args from decode %s: %s", msg.session_id, route)
        else:
            log.info("decode %s registered (rank %d of %d, %d KV buffers, %d head slice(s))", msg.session_id,
                     msg.tp_rank, msg.tp_size, len(msg.kv_ptrs), len(route.slices))

    def _refuse_session(self, msg: m.ToPrefill, reason: str) -> None:
        """A decode we cannot answer: refuse its session like a layout we cannot serve.

        Its rooms here fail (the scheduler releases them), the room a TransferInfo/AbortRoom
        names is failed or tombstoned, and none of its infos is kept, so nothing ever tries to
        reach that address again. It recovers by registering with a usable endpoint.
        """
        session = msg.session_id
        log.error("refusing decode %s: %s", session, reason)
        with self._lock:
            self._rejected[session] = reason
            self.forget_peer_locked(session)
            self.fail_session_locked(session, f"decode {session} refused: {reason}")
            for room, (_, infos) in list(self._orphans.items()):
                if infos.pop(session, None) is not None:
                    self._rooms.tombstone_locked(room, reason)
                    if not infos:
                        del self._orphans[room]
            room = getattr(msg, "room", None)
            if room is not None:
                r = self._rooms.get(room)
                if r is not None:
                    self.fail_locked(r, f"decode {session} refused: {reason}")
                else:
                    self._rooms.tombstone_locked(room, reason)

    def _on_info(self, info: m.TransferInfo) -> None:
        with self._lock:
            peer = self._peers.get(info.session_id)
            unregistered = peer is None or peer.instance_id != info.instance_id
            if unregistered:
                rejected = self._rejected.get(info.session_id)
                reason = f"prefill refused this decode's KV args: {rejected}" if rejected else "prefill has no KV args for this decode session"
                unregistered = rejected is None  # registering again would not help a rejected layout
            else:
                reason = wire.bad_destination(peer, info, self._routes[info.session_id])
            r = self._rooms.get(info.room)
            if r is None:
                tomb = self._rooms.tombstone_reason_locked(info.room)
                if (tomb is None and info.prompt_digest
                        and self._refused_senders.pop((info.room, info.prompt_digest), None) is not None):
                    tomb = (f"room {info.room}: the prefill request of this decode was refused here (the room was "
                            "another request's): rooms must be unique per request")
                if reason is None and tomb is None:  # the request has not reached this rank yet
                    _, infos = self._orphans.setdefault(info.room, (time.monotonic(), {}))
                    infos[info.session_id] = info
                    return
                if tomb is None:  # remember the failure for a sender created later
                    self._rooms.tombstone_locked(info.room, reason or "")
                reason = reason or tomb
            elif unregistered:
                # Nothing can be written for this session; the answer tells the decode to register again.
                self.fail_locked(r, reason or "")
            elif (refused := self._binding_refusal_locked(r, info)) is not None:
                # Another request's room (same id, other prompt or other decode): this decode
                # is told; the room, its own decode and its pages are left alone.
                log.warning("room %d: refusing decode %s: %s", info.room, info.session_id, refused)
                self._remember_refused_locked(self._refused_infos, info.room, info.prompt_digest)
                reason, unregistered = refused, False
            else:
                already_told = r.status is KVPoll.Failed and r.failure_sent
                r.infos[info.session_id] = info  # a failure is then reported to this decode too
                if reason is None:
                    self._add_info_locked(r, info)
                else:
                    self.fail_locked(r, reason)
                if not already_told:
                    return
                reason = r.reason
        # Nothing was or will be written for this room: answer the decode directly.
        self._push.send(info.status_endpoint, m.TransferStatus(
            room=info.room, status=int(KVPoll.Failed), prefill_rank=self._rank, reason=reason,
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
                self.fail_locked(r, reason)
                if not already_told:
                    return
                reason = r.reason or reason
            else:
                self._orphans.pop(msg.room, None)
                self._rooms.tombstone_locked(msg.room, reason)
        self._push.send(msg.status_endpoint, m.TransferStatus(
            room=msg.room, status=int(KVPoll.Failed), prefill_rank=self._rank, reason=reason))

    def tick(self) -> None:
        now = time.monotonic()
        timeout = self._config.bootstrap_timeout_s
        expired: list[tuple[int, m.TransferInfo]] = []
        with self._lock:
            for r in self._rooms.records_locked():
                if r.status is KVPoll.Bootstrapping and now - r.created > timeout:
                    self.fail_locked(r, f"no TransferInfo from the decode within {timeout:g}s (bootstrap timeout)")
            for room, (since, infos) in list(self._orphans.items()):
                if now - since > timeout:
                    del self._orphans[room]
                    expired.extend((room, i) for i in infos.values())
            self._rooms.expire_tombstones_locked(now)
            for table in (self._refused_infos, self._refused_senders):
                for key in [k for k, since in table.items() if now - since > timeout]:
                    del table[key]
            idle = self._idle_peers_locked(now)
        for peer in idle:
            log.info("forgetting decode %s: silent for %gs", peer.session_id, self._config.idle_peer_purge_s)
            self._push.purge(peer.status_endpoint)
        for room, info in expired:
            self._push.send(info.status_endpoint, m.TransferStatus(
                room=room, status=int(KVPoll.Failed), prefill_rank=self._rank,
                reason=f"prefill rank never received request for room {room} within {timeout:g}s"))

    def _idle_peers_locked(self, now: float) -> list[m.KVArgsRegister]:
        """Drop decodes gone silent with no room bound to them (restarted or scaled away)."""
        limit = self._config.idle_peer_purge_s
        busy = {s for r in self._rooms.records_locked() if not r.status.terminal for s in r.infos}
        idle = [p for s, p in self._peers.items() if s not in busy and now - self._last_heard.get(s, now) > limit]
        for p in idle:
            self.forget_peer_locked(p.session_id)
            self._last_heard.pop(p.session_id, None)
        for s in [s for s in self._last_heard if s not in self._peers and now - self._last_heard[s] > limit]:
            del self._last_heard[s]
            self._rejected.pop(s, None)
        return idle

    def _binding_refusal_locked(self, r: PrefillRoom, info: m.TransferInfo) -> str | None:
        """Why ``info`` may not join room ``r`` (None: it may). A room is bound to its prompt and,
        once it heard from as many decode sessions as it needs, to those sessions: a request that
        reuses a live room id can fail, never receive another request's KV."""
        if r.prompt_digest and info.prompt_digest and info.prompt_digest != r.prompt_digest:
            return (f"room {r.room} is another request's on this prefill (its prompt differs from this decode's): "
                    "rooms must be unique per request")
        if info.session_id not in r.infos and len(r.infos) >= info.required_dst_info_num:
            return f"room {r.room} is already bound to another decode: rooms must be unique per request"
        ps = self._args.layout.page_size
        if info.decode_prefix_len < 0 or info.decode_prefix_len % ps:
            return f"room {r.room}: decode_prefix_len {info.decode_prefix_len} is not a whole number of {ps}-token pages"
        if any(i.decode_prefix_len != info.decode_prefix_len for i in r.infos.values() if i.session_id != info.session_id):
            return f"room {r.room}: its decode ranks disagree on decode_prefix_len"
        return None

    # --- room changes a decode hears of (lock held) --------------------------------------------
    def _add_info_locked(self, r: PrefillRoom, info: m.TransferInfo) -> None:
        r.infos[info.session_id] = info
        r.decode_prefix_len = info.decode_prefix_len  # the same in every info (_binding_refusal_locked)
        if len(r.infos) >= info.required_dst_info_num:
            self._rooms.advance_locked(r, KVPoll.WaitingForInput)

    def fail_locked(self, r: PrefillRoom, reason: str) -> None:
        if self._rooms.advance_locked(r, KVPoll.Failed, reason):
            self.notify_failure_locked(r)

    def notify_failure_locked(self, r: PrefillRoom) -> None:
        """Tell each decode of a failed room, once, and only when no write to it is in flight."""
        if r.status is not KVPoll.Failed or r.inflight > 0 or r.failure_sent:
            return
        r.failure_sent = True
        for info in r.infos.values():
            self._push.send(info.status_endpoint, m.TransferStatus(
                room=r.room, status=int(KVPoll.Failed), prefill_rank=self._rank, reason=r.reason))

    def succeed_locked(self, r: PrefillRoom) -> None:
        """The last chunk was written: Success, and each decode is told."""
        r.status = KVPoll.Success
        for info in r.infos.values():
            self._push.send(info.status_endpoint, m.TransferStatus(
                room=r.room, status=int(KVPoll.Success), prefill_rank=self._rank))

    def fail_session_locked(self, session: str, reason: str) -> None:
        for r in self._rooms.records_locked():
            if session in r.infos:
                self.fail_locked(r, reason)
