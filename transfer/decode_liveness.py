"""The decode manager's liveness part: heartbeats, dead peers and the holding set's probes.

``DecodeLiveness`` is composed into ``DecodeKVManager`` (``transfer.decode``), which owns the
room table, the peer cache, the holding set and the sockets it is handed, and runs ``beat()``
on its heartbeat thread once per interval and ``on_pong`` on its status thread. Each beat pings
every cached prefill rank and declares dead one that missed ``heartbeat_max_failures`` periods;
it also probes every endpoint the holding set (``transfer.fenced``) holds rooms for: a refused
port releases them, a Pong from a new instance releases them, a Pong from the same instance gets
an AbortRoom per room (the prefill's answer releases it).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from transfer import messages as m
from transfer.config import KVManagerConfig
from transfer.fenced import FencedRooms
from transfer.peers import Peer, PeerCache, port_closed
from transfer.poll import KVPoll
from transfer.rooms import DecodeRoom, RoomTable
from transfer.zmq_io import PushSockets

log = logging.getLogger(__name__)


class DecodeLiveness:
    """``session_id`` and ``status_endpoint``: ours, named in every Ping and AbortRoom."""

    def __init__(self, config: KVManagerConfig, rooms: RoomTable[DecodeRoom], peers: PeerCache, fenced: FencedRooms,
                 push: PushSockets, session_id: str, status_endpoint: str,
                 rank_failed_locked: Callable[[DecodeRoom, int, str], None]) -> None:
        # rank_failed_locked(room, rank, reason): the manager's rule for a rank that can no
        # longer write into a room (lock held); the room fails once no source can still write.
        self._rank_failed_locked = rank_failed_locked
        self._config = config
        self._rooms, self._peers, self._fenced, self._push = rooms, peers, fenced, push
        self._lock = rooms.lock
        self._session_id, self._status_endpoint = session_id, status_endpoint
        self._probed: set[str] = set()  # endpoints the last fence probe pinged (heartbeat thread)

    # --- status thread -------------------------------------------------------------------------
    def on_pong(self, msg: m.Pong) -> None:
        with self._lock:
            aborts = self._fenced_pong_locked(msg)
            peer = self._peers.get(msg.endpoint)
            if peer is None:
                restarted = None
            elif peer.info.instance_id is not None and msg.instance_id != peer.info.instance_id:
                restarted = peer
            else:
                peer.acked_seq = max(peer.acked_seq, msg.seq)
                restarted = None
        for room in aborts:
            self._push.send(msg.endpoint, m.AbortRoom(room=room, session_id=self._session_id, status_endpoint=self._status_endpoint,
                                                      reason="fenced after its prefill was declared dead"))
        if restarted is not None:
            # A new process answers on the old endpoint: the old one released the port, it is gone.
            self.declare_dead(restarted, "prefill restarted", confirmed_gone=True)

    # --- heartbeat thread ----------------------------------------------------------------------
    def beat(self) -> None:
        dead: list[Peer] = []
        pings: list[tuple[str, int]] = []
        with self._lock:
            for peer in self._peers.peers_locked():
                seq = peer.heartbeat_tick()
                if peer.misses >= self._config.heartbeat_max_failures:
                    dead.append(peer)
                else:
                    pings.append((peer.endpoint, seq))
        for endpoint, seq in pings:
            self._push.send(endpoint, m.Ping(seq=seq, session_id=self._session_id, status_endpoint=self._status_endpoint))
        for peer in dead:
            self.declare_dead(peer, f"prefill {peer.endpoint} missed {peer.misses} heartbeats", confirmed_gone=None)
        self._probe_fenced()

    def declare_dead(self, peer: Peer, reason: str, confirmed_gone: bool | None) -> None:
        """Forget the peer (cache, routes, socket) and fail its rooms behind the fence."""
        with self._lock:
            if not self._peers.drop_locked(peer):
                return
        self._push.purge(peer.endpoint)
        if confirmed_gone is None:
            confirmed_gone = port_closed(peer.info.rank_ip, peer.info.rank_port)
        log.warning("%s; declared dead (%s)", reason, "gone" if confirmed_gone else "may be hung: quarantining its rooms")
        now = time.monotonic()
        aborts: list[DecodeRoom] = []
        with self._lock:
            for r in self._rooms.records_locked():
                rank = r.rank_of(peer.endpoint)
                if rank is None or r.status.terminal:
                    continue
                if r.info_sent_at is None:
                    self._rooms.advance_locked(r, KVPoll.Failed, r.pending_fail or reason)
                    continue
                started = r.pending_fail is None
                if confirmed_gone:
                    self._rank_failed_locked(r, rank, reason)
                else:
                    r.pending_fail = r.pending_fail or reason
                    r.fence_deadline = min(r.fence_deadline, now + self._config.hung_peer_quarantine_s)
                if started and not r.status.terminal:
                    aborts.append(r)  # the room's other ranks stop writing and answer
        for r in aborts:
            for other in r.unanswered():
                if other.endpoint != peer.endpoint and other.endpoint in self._peers:
                    self._push.send(other.endpoint, m.AbortRoom(room=r.room, session_id=self._session_id,
                                                                status_endpoint=self._status_endpoint,
                                                                reason=r.pending_fail or reason))

    # --- the holding set (transfer.fenced) -------------------------------------------------------
    def _fenced_pong_locked(self, msg: m.Pong) -> list[int]:
        """A Pong from an endpoint we hold rooms for: a new instance proves the old one gone; the
        same instance runs again: returns its rooms, to ask it to abort each (it answers after its
        own fence, or at once for a room it no longer knows)."""
        again: list[int] = []
        for room in self._fenced.rooms_of(msg.endpoint):
            entry = self._fenced.get(room, msg.endpoint)
            assert entry is not None
            if entry.instance_id is not None and entry.instance_id != msg.instance_id:
                if self._fenced.release_endpoint(room, msg.endpoint, f"a new instance answers on {msg.endpoint}"):
                    self._rooms.changed_locked()
            else:
                again.append(room)
        return again

    def _probe_fenced(self) -> None:
        """Each heartbeat: ping every endpoint we hold rooms for; a refused port releases them."""
        with self._lock:
            expired = self._fenced.older_than(self._config.max_fence_s, time.monotonic())
            for room in expired:
                self._fenced.release(room, f"held for the longest allowed ({self._config.max_fence_s:g} s, "
                                           "PDC_MAX_FENCE_S) without proof that its prefill cannot write")
            if expired:
                self._rooms.changed_locked()
            targets = self._fenced.endpoints()
            # A socket opened only to probe a peer whose rooms are all released goes too.
            done = [e for e in self._probed if e not in targets and e not in self._peers]
        for endpoint in done:
            self._push.purge(endpoint)
        self._probed = set(targets)
        for endpoint, (host, port, _) in targets.items():
            if port_closed(host, port):
                with self._lock:
                    for room in self._fenced.rooms_of(endpoint):
                        self._fenced.release_endpoint(room, endpoint, f"prefill {endpoint} is gone (port refused)")
                    self._rooms.changed_locked()
                if endpoint not in self._peers:
                    self._push.purge(endpoint)
            else:
                self._push.send(endpoint, m.Ping(seq=0, session_id=self._session_id, status_endpoint=self._status_endpoint))
