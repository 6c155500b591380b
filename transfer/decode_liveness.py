"""The decode manager's liveness half: heartbeats, dead peers and the holding set's probes.

``DecodeKVManager`` (transfer.decode) builds on this; it owns every attribute used here. Each
heartbeat interval the heartbeat thread pings every cached prefill rank and declares dead one
that missed ``heartbeat_max_failures`` periods; it also probes every endpoint the holding set
(``transfer.fenced``) holds rooms for: a refused port releases them, a Pong from a new instance
releases them, a Pong from the same instance gets an AbortRoom per room (the prefill's answer
releases it).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from transfer import messages as m
from transfer.config import KVManagerConfig
from transfer.fenced import FencedRooms
from transfer.peers import Peer, port_closed
from transfer.poll import KVPoll
from transfer.zmq_io import PushSockets

if TYPE_CHECKING:
    from transfer.base import DataPlane
    from transfer.decode import _Room

log = logging.getLogger(__name__)


class DecodeLiveness:
    config: KVManagerConfig
    engine: DataPlane
    status_endpoint: str
    _lock: threading.Lock
    _stop: threading.Event
    _push: PushSockets
    _peers: dict[str, Peer]
    _routes: dict[tuple[str, int], str]
    _dp_sizes: dict[str, int]
    _rooms: dict[int, _Room]
    _fenced: FencedRooms
    _probed: set[str]
    _state_changed: Callable[[], None]

    def _timers(self, now: float) -> None:
        raise NotImplementedError

    def _finalize_locked(self, r: _Room, status: KVPoll, reason: str | None) -> None:
        raise NotImplementedError

    def _on_pong(self, msg: m.Pong) -> None:
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
            self._push.send(msg.endpoint, m.AbortRoom(room=room, session_id=self.engine.session_id, status_endpoint=self.status_endpoint,
                                                      reason="fenced after its prefill was declared dead"))
        if restarted is not None:
            # A new process answers on the old endpoint: the old one released the port, it is gone.
            self._declare_dead(restarted, "prefill restarted", confirmed_gone=True)

    # --- heartbeat thread ----------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.wait(self.config.tick_s):
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval_s
                    self._heartbeat()
                self._timers(time.monotonic())
            except Exception:
                log.exception("heartbeat pass failed")

    def _heartbeat(self) -> None:
        dead: list[Peer] = []
        pings: list[tuple[str, int]] = []
        with self._lock:
            for peer in self._peers.values():
                seq = peer.heartbeat_tick()
                if peer.misses >= self.config.heartbeat_max_failures:
                    dead.append(peer)
                else:
                    pings.append((peer.endpoint, seq))
        for endpoint, seq in pings:
            self._push.send(endpoint, m.Ping(seq=seq, session_id=self.engine.session_id, status_endpoint=self.status_endpoint))
        for peer in dead:
            self._declare_dead(peer, f"prefill {peer.endpoint} missed {peer.misses} heartbeats", confirmed_gone=None)
        self._probe_fenced()

    def _declare_dead(self, peer: Peer, reason: str, confirmed_gone: bool | None) -> None:
        """Forget the peer (cache, routes, socket) and fail its rooms behind the fence."""
        with self._lock:
            if self._peers.get(peer.endpoint) is not peer:
                return
            del self._peers[peer.endpoint]
            for key in [k for k, e in self._routes.items() if e == peer.endpoint]:
                del self._routes[key]
            self._dp_sizes.pop(peer.bootstrap_addr, None)
        self._push.purge(peer.endpoint)
        if confirmed_gone is None:
            confirmed_gone = port_closed(peer.info.rank_ip, peer.info.rank_port)
        log.warning("%s; declared dead (%s)", reason, "gone" if confirmed_gone else "may be hung: quarantining its rooms")
        now = time.monotonic()
        with self._lock:
            for r in self._rooms.values():
                if r.endpoint != peer.endpoint or r.status.terminal:
                    continue
                if r.info_sent_at is None or confirmed_gone:
                    self._finalize_locked(r, KVPoll.Failed, r.pending_fail or reason)
                else:
                    r.pending_fail = r.pending_fail or reason
                    r.fence_deadline = min(r.fence_deadline, now + self.config.hung_peer_quarantine_s)


    # --- the holding set (transfer.fenced) -------------------------------------------------------
    def _fenced_pong_locked(self, msg: m.Pong) -> list[int]:
        """A Pong from an endpoint we hold rooms for: a new instance proves the old one gone; the
        same instance runs again: returns its rooms, to ask it to abort each (it answers after its
        own fence, or at once for a room it no longer knows)."""
        again: list[int] = []
        for room in self._fenced.rooms_of(msg.endpoint):
            entry = self._fenced.get(room)
            assert entry is not None
            if entry.instance_id is not None and entry.instance_id != msg.instance_id:
                self._fenced.release(room, f"a new instance answers on {msg.endpoint}")
                self._state_changed()
            else:
                again.append(room)
        return again

    def _probe_fenced(self) -> None:
        """Each heartbeat: ping every endpoint we hold rooms for; a refused port releases them."""
        with self._lock:
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
                        self._fenced.release(room, f"prefill {endpoint} is gone (port refused)")
                    self._state_changed()
                if endpoint not in self._peers:
                    self._push.purge(endpoint)
            else:
                self._push.send(endpoint, m.Ping(seq=0, session_id=self.engine.session_id, status_endpoint=self.status_endpoint))
