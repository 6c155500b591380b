"""The API process's end of the ZMQ link to its scheduler. The messages are ``common.ipc.protocol``'s;
the other end is ``common.ipc.node_io``.

One asyncio task reads ``from_scheduler`` and dispatches: each ``ReqOutput`` to the queue of
the HTTP request that owns its rid, each ``QueryReply`` to the future waiting for it. One task
drains an outgoing queue into ``to_scheduler``, so callers enqueue with a plain (non-async)
call — which is what cleanup paths in ``finally`` blocks and cancelled tasks need.

Rids on the wire. Each registered sequence gets a wire rid ``f"{rid}#{n}"`` (n counts up in this
process), used in every ``GenerateReq``/``AbortReq`` and mapped back to the client's rid in every
``ReqOutput`` (its ``error`` and finish message included). A client may reuse a rid as soon as its request is
closed — right after a disconnect, say, while the scheduler still runs or aborts the old sequence
(a prefill node lets it run on) — and the old sequence's late outputs then name a wire rid nobody
holds, so they are dropped instead of landing in the new request. Callers only see client rids.

A watchdog (optional ``scheduler_alive`` callable, checked every second) fails every in-flight
request with 503 once the scheduler process is gone, instead of leaving clients hanging.

A message that cannot be sent (it does not encode, the socket refuses it) fails only its own
request, with 500. Should the receive or send task stop anyway, the link is treated like a dead
scheduler: in-flight requests get 503 and ``gone_reason`` is set, so ``/health`` says 503 instead
of answering 200 while every request hangs.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from common.ipc.protocol import (
    AbortReq,
    BatchOutput,
    FlushCacheReq,
    GenerateReq,
    QueryReply,
    QueryReq,
    ReqOutput,
    ToScheduler,
    decode_from_scheduler,
    encode,
    new_query_id,
)
from common.request import FinishReason

logger = logging.getLogger(__name__)


class DuplicateRid(ValueError):
    pass


def wire_rid(rid: str, n: int) -> str:
    return f"{rid}#{n}"


def client_rid(wire: str) -> str:
    """The client's rid inside a wire rid (for logs and tests; routing never parses rids)."""
    return wire.rpartition("#")[0]


class SchedulerGone(RuntimeError):
    pass


class SchedulerClient:
    """Owns the PUSH/PULL sockets; routes scheduler output to per-request queues.

    Life cycle: ``await start()`` inside the server's event loop, ``await close()`` at shutdown.
    """

    def __init__(self, to_scheduler: str, from_scheduler: str,
                 scheduler_alive: Callable[[], bool] | None = None) -> None:
        self._to_addr = to_scheduler
        self._from_addr = from_scheduler
        self._alive = scheduler_alive
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._outbox: asyncio.Queue[ToScheduler] = asyncio.Queue()
        self._routes: dict[str, tuple[str, asyncio.Queue[ReqOutput]]] = {}  # wire rid -> (rid, owner's queue)
        self._wire: dict[str, str] = {}  # rid -> wire rid of its live sequence
        self._seq = itertools.count()
        self._queries: dict[str, asyncio.Future[dict]] = {}
        self._tasks: list[asyncio.Task] = []
        self.ready = asyncio.Event()  # set by the first message from the scheduler
        self.gone_reason: str | None = None
        self.last_heard: float = 0.0

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._from_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._to_addr)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._recv_loop(), name="sched-recv"),
                       loop.create_task(self._send_loop(), name="sched-send"),
                       loop.create_task(self._watchdog(), name="sched-watchdog"),
                       loop.create_task(self._probe(), name="sched-probe")]
        for t in self._tasks[:3]:  # the probe ends by design once the scheduler answered
            t.add_done_callback(self._task_ended)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        # A task that died has been logged (and failed the link) already: do not raise it here.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._ctx = self._push = self._pull = None

    # ---- requests ---------------------------------------------------------------------------

    def register(self, rids: list[str]) -> asyncio.Queue[ReqOutput]:
        """One queue that receives the outputs of all ``rids`` (one HTTP request's sequences)."""
        if self.gone_reason is not None:
            raise SchedulerGone(self.gone_reason)
        dup = [r for r in rids if r in self._wire]
        if dup:
            raise DuplicateRid(f"request id {dup[0]!r} is already in flight")
        q: asyncio.Queue[ReqOutput] = asyncio.Queue()
        for r in rids:
            w = wire_rid(r, next(self._seq))
            self._wire[r] = w
            self._routes[w] = (r, q)
        return q

    def unregister(self, rids: list[str]) -> None:
        """Stop listening; later outputs of these sequences are dropped, and the rids are free."""
        for r in rids:
            w = self._wire.pop(r, None)
            if w is not None:
                del self._routes[w]

    def is_inflight(self, rid: str) -> bool:
        return rid in self._wire

    def inflight_rids(self) -> list[str]:
        return list(self._wire)

    def send(self, msg: GenerateReq) -> None:
        """Send a registered sequence (``msg.rid`` is the client's rid)."""
        w = self._wire.get(msg.rid)
        if w is None:  # a caller bug: an unregistered sequence could never be answered
            raise KeyError(f"request id {msg.rid!r} is not registered")
        self._outbox.put_nowait(msgspec.structs.replace(msg, rid=w))

    def abort(self, rid: str) -> None:
        """Abort the live sequence ``rid``; nothing to do once it finished or was unregistered."""
        w = self._wire.get(rid)
        if w is not None:
            self._outbox.put_nowait(AbortReq(rid=w))

    # ---- queries ----------------------------------------------------------------------------

    async def query(self, what: str, timeout: float) -> dict:
        """QueryReq round trip; ``TimeoutError`` when the scheduler does not answer in time."""
        return await self._round_trip(lambda qid: QueryReq(query_id=qid, what=what), timeout)  # type: ignore[arg-type]

    async def flush_cache(self, timeout: float) -> dict:
        return await self._round_trip(lambda qid: FlushCacheReq(query_id=qid), timeout)

    async def _round_trip(self, make: Callable[[str], QueryReq | FlushCacheReq], timeout: float) -> dict:
        if self.gone_reason is not None:
            raise SchedulerGone(self.gone_reason)
        qid = new_query_id()
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            self._outbox.put_nowait(make(qid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._queries.pop(qid, None)

    # ---- background tasks -------------------------------------------------------------------

    async def _send_loop(self) -> None:
        assert self._push is not None
        while True:
            msg = await self._outbox.get()
            try:
                await self._push.send(encode(msg), copy=False)
            except Exception as exc:  # keep the loop: one bad message must not silence the link
                logger.exception("could not send %s to the scheduler", type(msg).__name__)
                if isinstance(msg, GenerateReq):
                    self._fail_request(msg.rid, f"{type(exc).__name__}: {exc}")

    def _fail_request(self, wire: str, why: str) -> None:
        """Finish one sequence with 500 (a fault of this process, not of the client or a peer)."""
        route = self._routes.pop(wire, None)
        if route is None:
            return  # unregistered meanwhile: nobody waits
        rid, q = route
        del self._wire[rid]
        reason = f"could not send request {rid!r} to the scheduler: {why}"
        q.put_nowait(ReqOutput(rid=rid, finish=FinishReason(type="abort", message=reason),
                               error=reason, http_status=500))

    def _task_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or self.gone_reason is not None:
            return  # close(), or the scheduler is already known to be gone
        exc = task.exception()
        if exc is None and task.get_name() == "sched-watchdog":
            return  # no liveness callable: nothing to watch
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        logger.error("background task %s of the scheduler link stopped%s", task.get_name(), why,
                     exc_info=exc)
        self._fail_all(f"the API process lost its link to the scheduler ({task.get_name()} stopped{why})")

    async def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            try:
                buf = await self._pull.recv(copy=True)
            except zmq.ZMQError:
                logger.exception("receiving from the scheduler failed")
                await asyncio.sleep(0.1)
                continue
            try:
                self._dispatch(buf)
            except Exception:  # a bug in dispatch must not stop all future output
                logger.exception("error dispatching scheduler output")

    def _dispatch(self, buf: bytes) -> None:
        msg = decode_from_scheduler(buf)
        if msg is None:
            return
        self.last_heard = time.monotonic()
        self.ready.set()
        if isinstance(msg, BatchOutput):
            for item in msg.items:
                wire = item.rid
                route = self._routes.get(wire)
                if route is None:
                    continue  # aborted / disconnected / already answered: nobody listens
                rid, q = route
                if item.finish is not None:  # the last output: the rid is free again
                    del self._routes[wire]
                    del self._wire[rid]
                item.rid = rid
                if item.error is not None:  # the scheduler names the sequence by its wire rid
                    item.error = item.error.replace(wire, rid)
                if item.finish is not None and item.finish.message is not None:
                    item.finish.message = item.finish.message.replace(wire, rid)
                q.put_nowait(item)
        elif isinstance(msg, QueryReply):
            fut = self._queries.get(msg.query_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.payload)

    async def _probe(self) -> None:
        """Ask for the load until the scheduler first answers: /health is 503 until then."""
        while not self.ready.is_set() and self.gone_reason is None:
            with contextlib.suppress(TimeoutError, SchedulerGone):
                await self.query("load", timeout=0.5)

    async def _watchdog(self) -> None:
        if self._alive is None:
            return
        while self.gone_reason is None:
            await asyncio.sleep(1.0)
            if not self._alive():
                self._fail_all("the scheduler process exited")

    def _fail_all(self, reason: str) -> None:
        logger.error("%s; failing %d in-flight requests", reason, len(self._routes))
        self.gone_reason = reason
        for rid, q in self._routes.values():
            q.put_nowait(ReqOutput(rid=rid, finish=FinishReason(type="abort", message=reason),
                                   error=reason, http_status=503))
        self._routes.clear()
        self._wire.clear()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(SchedulerGone(reason))
