"""Decode-side knowledge of prefill ranks: the connection cache and the liveness probe.

A ``Peer`` is one prefill rank this decode talks to, keyed by its control endpoint. It is created
by a bootstrap lookup, holds whether our KV args were registered there, and carries heartbeat
bookkeeping (Ping sequence numbers sent and acknowledged). ``PeerCache`` holds them with the
routes to them. When a peer is declared dead it is dropped together with every route to it
(and, by the manager, its PUSH socket), so the next room looks the rank up again and reaches a
restarted prefill at once.

Caches, all guarded by the lock the owner passes in (its room table's: ``transfer.rooms``)::

    addr -> (dp_size, TPMap)                 the prefill's layout, checked once against ours, and
                                             which of its ranks this decode rank draws on
    (addr, dp group, rank) -> endpoint       where each of those ranks listens
    endpoint -> Peer                         the rank itself
    addr -> (expiry, reason)                 a failed lookup, answered from here for a while

A room links this decode rank to every prefill rank it sends a TransferInfo to (``Links``): the
sources of its heads and any unused replica it tells so (``transfer.tp_map``). At equal TP that
is rank r alone.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from bootstrap_server.errors import RankNotRegistered
from bootstrap_server.schema import DecodeLayout, RankInfo, check_receivable

from transfer.base import BootstrapClient
from transfer.errors import TransferError
from transfer.tp_map import HeadSlice, TPMap, equal_plan, plan


@dataclass
class Peer:
    bootstrap_addr: str
    info: RankInfo
    registered: bool = False  # our KVArgsRegister was queued to it
    sent_seq: int = 0  # last Ping sent
    acked_seq: int = 0  # highest Pong received
    misses: int = 0  # consecutive heartbeat periods without a Pong

    @property
    def endpoint(self) -> str:
        return self.info.endpoint

    def heartbeat_tick(self) -> int:
        """Account for the last period; return the next Ping seq to send."""
        self.misses = self.misses + 1 if self.acked_seq < self.sent_seq else 0
        self.sent_seq += 1
        return self.sent_seq


@dataclass(frozen=True)
class Links:
    """The prefill ranks one room of this decode rank involves (see the module docstring)."""

    peers: dict[int, Peer]  # prefill rank -> peer: every rank that gets our TransferInfo
    sources: tuple[int, ...]  # the ranks that write our heads
    required: dict[int, int]  # prefill rank -> the required_dst_info_num it expects
    slices: tuple[HeadSlice, ...]  # the head slices we receive
    scatter: bool  # some slice lands in the staging area first (transfer.staging)
    resharded: bool = False  # the prefill's TP size differs: our pages are not one rank's pages


class PeerCache:
    """The prefill ranks one decode rank has looked up (see the module docstring).

    ``resolve`` takes the lock around each cache access and none around a lookup (HTTP, on the
    connect thread); the other calls expect the caller to hold it.
    """

    def __init__(self, lock: threading.Lock, bootstrap: BootstrapClient, layout: DecodeLayout, tp_rank: int) -> None:
        self._lock, self._bootstrap, self._layout, self._tp_rank = lock, bootstrap, layout, tp_rank
        self._peers: dict[str, Peer] = {}  # prefill control endpoint -> peer
        self._routes: dict[tuple[str, int, int], str] = {}  # (bootstrap addr, dp group, rank) -> endpoint
        self._plans: dict[str, tuple[int, TPMap]] = {}  # bootstrap addr -> (prefill dp_size, plan)
        self._negative: dict[str, tuple[float, str]] = {}  # bootstrap addr -> (expiry, why lookups fail)

    def resolve(self, addr: str, room: int) -> Links:
        """The prefill ranks ``room`` involves (cached); raises when they cannot be found or
        received from: ``LayoutMismatch`` names the field, at lookup, before anything is sent."""
        with self._lock:
            neg = self._negative.get(addr)
            if neg is not None and neg[0] > time.monotonic():
                raise TransferError(neg[1] + " (cached)")
            cached = self._plans.get(addr)
        if cached is None:
            layout = self._bootstrap.lookup_layout(addr)
            if not layout.complete:  # its sources may be among the ranks still missing
                raise RankNotRegistered(f"prefill layout incomplete: {layout.registered_ranks} of "
                                        f"{layout.expected_ranks} ranks registered", url=addr, status=404)
            check_receivable(layout, self._layout)  # LayoutMismatch names every bad field
            if layout.tp_size == self._layout.tp_size:  # rank r <- rank r, known head counts or not
                tp = equal_plan(layout.tp_size, self._layout.num_kv_heads)
            else:  # check_receivable saw both counts, equal
                tp = plan(layout.tp_size, self._layout.tp_size, self._layout.total_kv_heads or 0)
            cached = (layout.dp_size, tp)
            with self._lock:
                self._plans[addr] = cached
        dp_size, tp = cached
        group, d = room % dp_size, self._tp_rank
        peers = {p: self._peer(addr, group, p) for p in tp.contacts(d)}
        slices = tp.recv[d]
        return Links(peers=peers, sources=tp.sources(d), required={p: tp.required_dst_info_num(p) for p in peers},
                     slices=slices, scatter=any(s.num_heads < self._layout.num_kv_heads for s in slices),
                     resharded=tp.prefill_tp != tp.decode_tp)

    def node_endpoints(self, addr: str, room: int) -> list[str]:
        """Every rank of the prefill's dp group serving ``room``, receivable or not (uncached):
        where a refusal is sent, so each rank's sender fails now rather than at its timeout."""
        layout = self._bootstrap.lookup_layout(addr)
        return [self._bootstrap.lookup_rank(addr, p, room % layout.dp_size).endpoint for p in range(layout.tp_size)]

    def _peer(self, addr: str, group: int, rank: int) -> Peer:
        key = (addr, group, rank)
        with self._lock:
            endpoint = self._routes.get(key)
            if endpoint is not None and endpoint in self._peers:
                return self._peers[endpoint]
        info = self._bootstrap.lookup_rank(addr, rank, group)
        with self._lock:
            peer = self._peers.get(info.endpoint)
            if peer is None or peer.info.instance_id != info.instance_id:
                peer = self._peers[info.endpoint] = Peer(addr, info)
            self._routes[key] = info.endpoint
            return peer

    def lookup_failed_locked(self, addr: str, reason: str, for_s: float) -> None:
        """Answer lookups of ``addr`` with ``reason`` for ``for_s`` seconds."""
        self._negative[addr] = (time.monotonic() + for_s, reason)

    def expire_failures_locked(self, now: float) -> None:
        for addr in [a for a, (expiry, _) in self._negative.items() if expiry <= now]:
            del self._negative[addr]

    def get(self, endpoint: str | None) -> Peer | None:
        return None if endpoint is None else self._peers.get(endpoint)

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._peers

    def peers_locked(self) -> list[Peer]:
        return list(self._peers.values())

    def drop_locked(self, peer: Peer) -> bool:
        """Forget ``peer`` with its routes and its prefill's layout (False: not the cached one)."""
        if self._peers.get(peer.endpoint) is not peer:
            return False
        del self._peers[peer.endpoint]
        for key in [k for k, e in self._routes.items() if e == peer.endpoint]:
            del self._routes[key]
        self._plans.pop(peer.bootstrap_addr, None)
        return True


def port_closed(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when nothing listens on host:port any more (the process that owned it is gone).

    A refused connection proves the prefill rank's process released its control port, so it can no
    longer write into our memory. A timeout or success proves nothing (hung, or network down).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
