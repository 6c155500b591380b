"""The scheduler process's end of the API <-> scheduler link (role-agnostic). The messages are
``common.ipc.protocol``'s; the other end is ``common.ipc.scheduler_client``.

::

    API process                        scheduler process (this module)
    PUSH ---- GenerateReq | AbortReq ---> PULL  recv(): work items returned to the loop
              QueryReq | FlushCacheReq          answered here at once, from ``NodeStats``
    PULL <--- BatchOutput | QueryReply --- PUSH  send(): one BatchOutput per step

The scheduler loop calls ``recv`` once per step. It never blocks longer than the ``timeout_s``
it passes (0 while there is work; longer when idle, so an idle node does not spin a core); a
message or a ``wake()`` from a transfer thread (a room's state changed) ends the wait at once; and
it reads at most ``max_batch`` messages per call so a flood cannot starve the forward pass.
Queries are answered inside ``recv``: ``/get_load``, ``/metrics`` and ``/debug/memory`` see the
state between two steps, never a half-updated one, and need no lock. A query handler that raises
answers ``{"error": ...}`` instead of taking the loop down.

Sends never block either: if the API process is gone and its queue is full, output is dropped
with a log line (the API's own watchdog fails its clients).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import zmq

from common.ipc.protocol import (
    AbortReq,
    BatchOutput,
    FlushCacheReq,
    GenerateReq,
    IpcEndpoints,
    QueryReply,
    QueryReq,
    ReqOutput,
    WorkItem,
    decode_to_scheduler,
    encode,
)

log = logging.getLogger(__name__)

_SNDHWM = 100_000  # outgoing messages queued for the API before sends are dropped


class NodeStats(Protocol):
    """What a node's scheduler exposes to the ops endpoints (payload shapes: common/ipc/protocol.py)."""

    def load(self) -> dict[str, int]:
        """``{"num_reqs", "num_waiting_reqs", "num_tokens"}`` for /get_load."""
        ...

    def memory(self) -> dict:
        """Pool counters for /debug/memory (JSON-serialisable)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat ``{name: number}``; each becomes the gauge ``pdc_scheduler_<name>``."""
        ...

    def flush_cache(self) -> tuple[bool, str]:
        """Drop the prefix cache: (success, message); refused while requests hold pages."""
        ...


class NodeIO:
    def __init__(self, endpoints: IpcEndpoints, stats: NodeStats, max_batch: int = 4096, *,
                 defer_flush: bool = False, rank_wakes: bool = False) -> None:
        """``defer_flush`` (TP nodes): a /flush_cache request is not answered inside ``recv`` but
        queued in ``flushes`` for the loop, which flushes every rank at the same step and answers
        with ``reply_flush``; flushing rank 0 alone would leave the ranks' caches different.
        ``rank_wakes`` (TP nodes): the other ranks' ``RankWaker``s end the wait too."""
        self._stats = stats
        self._defer_flush = defer_flush
        self.flushes: list[FlushCacheReq] = []
        self._max_batch = max_batch
        self._ctx = zmq.Context()
        try:
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.bind(endpoints.to_scheduler)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.setsockopt(zmq.SNDHWM, _SNDHWM)
            self._push.connect(endpoints.from_scheduler)
        except BaseException:  # e.g. an ipc path that cannot be bound: no socket may outlive this
            self._ctx.destroy(linger=0)
            raise
        # A self-pipe that transfer threads write to when a room's state changes: recv() waits on
        # it and the socket at once, so the loop sees a finished transfer now, not a poll later.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # On a TP node rank 0 paces every rank's loop, but each rank's transfer threads see only
        # their own rooms: the other ranks wake it through this datagram socket, so a room that
        # finishes last on rank 1 is stepped on now, not at the next busy-wait timeout.
        self._rank_wake: socket.socket | None = None
        self._rank_wake_path: str | None = None
        if rank_wakes:
            address = endpoints.rank_wake_address()
            self._rank_wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._rank_wake.setblocking(False)
            self._rank_wake.bind(address)
            self._rank_wake_path = None if address.startswith("\0") else address
            self._poller.register(self._rank_wake.fileno(), zmq.POLLIN)
        self._closed = False
        self.dropped_outputs = 0

    def wake(self) -> None:
        """End the current (or next) ``recv`` wait. Any thread; never blocks; cheap when repeated."""
        if self._closed:  # the node closes its transfer manager (the waking threads) first
            return
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):  # the pipe is full (a wake is pending anyway) or closed
            pass

    # -- receive ------------------------------------------------------------------------------

    def recv(self, timeout_s: float = 0.0) -> list[WorkItem]:
        """Work items that arrived, in order; waits at most ``timeout_s`` for the first one.

        Queries that arrive are answered before this returns; they end the wait too (the loop
        then simply polls again), so an idle node answers /get_load within one poll.
        """
        items: list[WorkItem] = []
        if timeout_s > 0:
            ready = dict(self._poller.poll(int(timeout_s * 1000)))
            if self._wake_r in ready:
                self._drain_wakes()
            if self._rank_wake is not None and self._rank_wake.fileno() in ready:
                self._drain_rank_wakes()
            if self._pull not in ready:
                return items
        for _ in range(self._max_batch):
            try:
                buf = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = decode_to_scheduler(buf)  # logs and returns None on a malformed frame
            if isinstance(msg, (GenerateReq, AbortReq)):
                items.append(msg)
            elif isinstance(msg, QueryReq):
                self._reply(msg.query_id, self._answer(msg.what))
            elif isinstance(msg, FlushCacheReq):
                if self._defer_flush:
                    self.flushes.append(msg)
                else:
                    self._reply(msg.query_id, self._flush())
        return items

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drain_rank_wakes(self) -> None:
        assert self._rank_wake is not None
        try:
            while self._rank_wake.recv(64):
                pass
        except BlockingIOError:
            pass

    def _answer(self, what: str) -> dict:
        try:
            if what == "load":
                return dict(self._stats.load())
            if what == "memory":
                return dict(self._stats.memory())
            if what == "metrics":
                return dict(self._stats.metrics())
            if what == "kv_snapshot":  # only a node whose prefix cache publishes KV events has it
                snapshot = getattr(self._stats, "kv_snapshot", None)
                return {"error": "this node publishes no KV events"} if snapshot is None else dict(snapshot())
            return {"error": f"unknown query {what!r}"}
        except Exception as exc:  # a stats bug must not stop the scheduler loop
            log.exception("answering the %s query failed", what)
            return {"error": f"{what} query failed: {type(exc).__name__}: {exc}"}

    def _flush(self) -> dict:
        return flush_cache(self._stats)

    def reply_flush(self, query_id: str, result: dict) -> None:
        """Answer a deferred /flush_cache with ``flush_cache``'s result."""
        self._reply(query_id, result)

    # -- send ---------------------------------------------------------------------------------

    def send(self, items: Sequence[ReqOutput]) -> None:
        """One BatchOutput with every item (nothing is sent for an empty list)."""
        if items:
            self._send(encode(BatchOutput(items=list(items))), len(items))

    def _reply(self, query_id: str, payload: dict) -> None:
        self._send(encode(QueryReply(query_id=query_id, payload=payload)), 0)

    def _send(self, data: bytes, num_items: int) -> None:
        if self._closed:
            return
        try:
            self._push.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_outputs += num_items
            log.error("API process not reading: dropped a message with %d outputs", num_items)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pull.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()
        os.close(self._wake_w)  # a late wake() from a transfer thread then gets OSError, ignored
        os.close(self._wake_r)
        if self._rank_wake is not None:
            self._rank_wake.close()
            if self._rank_wake_path is not None:
                try:
                    os.unlink(self._rank_wake_path)
                except FileNotFoundError:
                    pass


class RankWaker:
    """A TP rank's (rank >= 1) ``wake()``: ends rank 0's ``NodeIO.recv`` wait when one of this
    rank's rooms (or grammars) changes state. Any thread; never blocks; a wake sent before rank 0
    bound its socket, or after it closed, is dropped (its busy-wait timeout is the backstop)."""

    def __init__(self, endpoints: IpcEndpoints) -> None:
        self._address = endpoints.rank_wake_address()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._closed = False

    def wake(self) -> None:
        if self._closed:  # the rank closes its transfer manager (the waking threads) first
            return
        try:
            self._sock.sendto(b"w", self._address)
        except OSError:  # not bound (yet, or any more), or its queue is full: a wake is pending anyway
            pass

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def flush_cache(stats: NodeStats) -> dict:
    """``stats.flush_cache()`` as the /flush_cache answer; a failure is an answer, not an exception."""
    try:
        ok, message = stats.flush_cache()
    except Exception as exc:
        log.exception("flush_cache failed")
        ok, message = False, f"flush_cache failed: {type(exc).__name__}: {exc}"
    return {"success": ok, "message": message}


class RateMeter:
    """Events per second over a sliding window (``gen_throughput`` and friends).

    ``add(n)`` once per step; ``rate()`` = events in the last ``window_s`` / the span covered.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self._window = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        self._events.append((now, n))
        self._total += n
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return self._total / max(span, min(self._window, 1.0))

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self._window:
            _, n = self._events.popleft()
            self._total -= n
