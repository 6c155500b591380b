"""ZMQ plumbing shared by both managers: a cache of PUSH sockets, a PULL serving loop, and the
``ControlPlane`` that holds them with the manager's threads and closes them in order.

ZMQ sockets are not thread-safe: each PUSH socket is guarded by its own lock (several threads
send), each PULL socket is used only by the thread that serves it. Sends never block: a peer
whose queue is full or that is gone simply loses the message, and the protocol's timeouts and
heartbeats turn that into a Failed room. With a ``ControlAuth`` every frame sent is sealed with
the cluster secret's tag and every frame received must carry a valid one (transfer/control_auth.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from common.auth import RefusalLog
from transfer import messages
from transfer.control_auth import ControlAuth

log = logging.getLogger(__name__)

_SNDHWM = 10_000  # messages queued per peer before sends are dropped


class PushSockets:
    """PUSH sockets by endpoint, created on first use, purged when a peer is declared dead."""

    def __init__(self, ctx: zmq.Context, auth: ControlAuth | None = None) -> None:
        self._ctx = ctx
        self.auth = auth  # seals what is sent; the manager's PULL loop checks with the same
        self._lock = threading.Lock()
        self._socks: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._closed = False

    def _get(self, endpoint: str) -> tuple[zmq.Socket, threading.Lock] | None:
        with self._lock:
            if self._closed:
                return None
            entry = self._socks.get(endpoint)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                try:
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, _SNDHWM)
                    sock.connect(endpoint)  # raises on an address ZMQ cannot parse
                except zmq.ZMQError:
                    sock.close(linger=0)
                    raise
                entry = self._socks[endpoint] = (sock, threading.Lock())
            return entry

    def send(self, endpoint: str, msg: messages.ToPrefill | messages.ToDecode) -> bool:
        """Queue ``msg`` for ``endpoint``; False when it could not be queued. Never raises.

        Callers send from timer passes, workers and handlers, often under their manager's lock
        and half-way through a state change: a send that raised there would leave that change
        half done. A message that cannot go is lost like one to a dead peer, and the protocol's
        timeouts and heartbeats already turn that into a Failed room.
        """
        try:
            entry = self._get(endpoint)
            if entry is None:
                return False
            sock, lock = entry
            data = messages.encode(msg)
            if self.auth is not None:
                data = self.auth.seal(data)
            with lock:
                if sock.closed:
                    return False
                sock.send(data, zmq.NOBLOCK)
                return True
        except zmq.ZMQError as exc:  # bad address, Again (queue full), or closed under us
            log.warning("dropping %s to %s: %s", type(msg).__name__, endpoint, exc)
        except Exception:
            log.exception("dropping %s to %s", type(msg).__name__, endpoint)
        return False

    def purge(self, endpoint: str, flush_s: float = 0.0) -> None:
        """Forget the socket to a peer.

        ``flush_s == 0``: what is still queued is discarded (a dead peer: nothing may reach a
        successor on the same address). ``flush_s > 0``: it still gets that long to leave in
        the background (a peer we drop but are telling why: those messages are the point).
        """
        with self._lock:
            entry = self._socks.pop(endpoint, None)
        if entry is not None:
            sock, lock = entry
            with lock:
                sock.close(linger=int(flush_s * 1000))

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._socks)

    def close(self, flush_s: float = 0.0) -> None:
        """Close every socket; queued messages get ``flush_s`` to leave (the context's
        ``term()`` waits that long at most for them)."""
        with self._lock:
            self._closed = True
            entries = list(self._socks.values())
            self._socks.clear()
        for sock, lock in entries:
            with lock:
                sock.close(linger=int(flush_s * 1000))


def bind_pull(ctx: zmq.Context, host: str) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, port


def serve_pull(
    sock: zmq.Socket,
    decode: Callable[[bytes], object],
    handle: Callable[[object], None],
    on_tick: Callable[[], None],
    stop: threading.Event,
    tick_s: float,
    name: str,
    auth: ControlAuth | None = None,
) -> None:
    """Receive, decode and handle messages until ``stop``; a bad message is logged and dropped.

    ``on_tick`` runs at least every ``tick_s`` (timers). Nothing a peer sends can end the loop:
    decode errors and handler exceptions are both caught here. With ``auth`` a frame without a
    valid tag is dropped before it is decoded. Closes ``sock`` on exit.
    """
    refusals = RefusalLog(log, f"{name}: a control message without a valid cluster-secret tag "
                               "(a peer without the cluster secret, or with another one)")
    try:
        while not stop.is_set():
            if sock.poll(int(tick_s * 1000)):
                frames = sock.recv_multipart(zmq.NOBLOCK)
                msg: object = None
                try:
                    if len(frames) != 1:
                        raise msgspec.DecodeError(f"expected 1 frame, got {len(frames)}")
                    payload = frames[0] if auth is None else auth.open(frames[0])
                    if payload is None:
                        refusals.refused(f"{len(frames[0])} bytes dropped")
                    else:
                        msg = decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("%s: dropping malformed message (%d bytes): %s", name, sum(map(len, frames)), exc)
                if msg is not None:
                    try:
                        handle(msg)
                    except Exception:
                        log.exception("%s: handler failed on %s; dropped", name, type(msg).__name__)
            try:
                on_tick()
            except Exception:
                log.exception("%s: timer pass failed", name)
    finally:
        sock.close(linger=0)


class ControlPlane:
    """One KV manager's control plane, either role: a ZMQ context, the PUSH sockets to its peers,
    the PULL socket it serves on its rank's host (``endpoint``), the ``stop`` event its
    background threads watch, and the teardown order both managers need (threads first, then
    the sockets, then the context)."""

    def __init__(self, host: str, auth: ControlAuth | None) -> None:
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.push = PushSockets(self.ctx, auth)
        self.pull, self.port = bind_pull(self.ctx, host)
        self.endpoint = f"tcp://{host}:{self.port}"
        self.threads: list[threading.Thread] = []

    def server(self, name: str, decode: Callable[[bytes], object], handle: Callable[[object], None],
               on_tick: Callable[[], None], tick_s: float, what: str) -> threading.Thread:
        """The thread that serves the PULL socket (``serve_pull``, checked with the PUSH side's key)."""
        return threading.Thread(target=serve_pull, name=name, daemon=True,
                                args=(self.pull, decode, handle, on_tick, self.stop, tick_s, what, self.push.auth))

    def abandon(self) -> None:
        """Close what ``__init__`` opened, for a start-up that failed before any thread ran."""
        self.pull.close(linger=0)
        self.push.close()
        self.ctx.term()

    def start(self, threads: list[threading.Thread]) -> None:
        self.threads = threads
        for t in threads:
            t.start()

    def join(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` in all for the threads (``stop`` set first); the names of
        those still running."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def close(self, flush_s: float = 0.0) -> None:
        """Close the PUSH sockets (queued messages get ``flush_s`` to leave) and the context; the
        PULL socket was closed by its serving thread."""
        self.push.close(flush_s=flush_s)
        self.ctx.term()
