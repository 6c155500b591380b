"""Run one parsed HTTP request against the scheduler and answer it (JSON or SSE).

Life of a request in the API process::

    parse (400 on bad input, nothing sent)  ->  register rids (400 duplicate, 503 scheduler gone)
      -> send one GenerateReq per sequence  ->  fold ReqOutputs into SubStates as they arrive
      -> JSON once every sequence finished, or SSE chunks as text becomes visible
      -> close(): unregister; on the decode role, AbortReq for every unfinished sequence

A stream's status line is sent only with its first chunk, so a request that fails before any
output (a failed KV transfer: the common case) still gets a plain 5xx JSON error naming the
cause, and the router may retry it. Later failures become an SSE ``{"error": ...}`` chunk.

Client disconnects are watched with a task reading the ASGI receive channel (uvicorn reports
``http.disconnect`` there; writes to a closed socket do not fail). The decode role aborts the
sequences; the prefill role lets them run to their end, because the decode node is waiting for
that KV whether or not the router still listens to the prefill answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.ipc.protocol import GenerateReq, ReqOutput
from common.server.errors import error_body, error_response
from common.server.metrics import ApiMetrics
from common.server.outputs import SubState
from common.server.parse_common import ParsedRequest
from common.server.responses import DONE, StreamShaper, sse, whole_body
from common.ipc.scheduler_client import DuplicateRid, SchedulerClient, SchedulerGone
from common.server.textio import TokenizerLike

CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it


class Inflight:
    """One HTTP request's sequences while the scheduler runs them."""

    def __init__(self, client: SchedulerClient, req: ParsedRequest, tok: TokenizerLike, metrics: ApiMetrics,
                 abort_on_close: bool, endpoint: str, registry: dict[str, Inflight]) -> None:
        self.client = client
        self._registry = registry  # parent rid -> Inflight, for /abort_request
        self.req = req
        self.states = [SubState.new(s, tok) for s in req.subs]
        self._by_rid = {s.sub.rid: s for s in self.states}
        self._metrics = metrics
        self._abort_on_close = abort_on_close
        self._endpoint = endpoint
        self._queue: asyncio.Queue[ReqOutput | None] | None = None
        self._held: list[ReqOutput | None] = []  # taken from the queue by next_batch, not yet folded
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self.status = 200

    def start(self, request: Request | None) -> None:
        """Register and send; raises DuplicateRid / SchedulerGone before anything is sent."""
        if self.req.rid in self._registry:
            raise DuplicateRid(f"request id {self.req.rid!r} is already in flight")
        self._queue = self.client.register(list(self._by_rid))  # type: ignore[assignment]
        self._registry[self.req.rid] = self
        self._metrics.on_inflight(len(self.states))
        for s in self.states:
            sub = s.sub
            self.client.send(GenerateReq(
                rid=sub.rid, input_ids=sub.input_ids, sampling=sub.sampling, stream=self.req.stream,
                bootstrap_host=sub.bootstrap_host, bootstrap_port=sub.bootstrap_port,
                bootstrap_room=sub.bootstrap_room, arrival_time=self.req.arrival_time))
        if request is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        assert self._queue is not None
        self._queue.put_nowait(None)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.states)

    async def next(self) -> tuple[SubState, str] | None:
        """The next (sequence, newly visible text); None once the client is gone."""
        assert self._queue is not None
        out = self._held.pop() if self._held else await self._queue.get()
        return None if out is None else self._fold(out)

    async def next_batch(self) -> list[tuple[SubState, str]] | None:
        """The next output and every one already queued behind it, one entry per sequence with
        its texts joined; None once the client is gone.

        A stream whose client (or the event loop) falls behind the decode steps then sends one
        larger chunk instead of a backlog of one-token chunks, which cost this process, the
        router and the client a write and a JSON body each. A failure is never merged: it is
        held back for the next call, so the text before it still goes out on its own, as before.
        """
        assert self._queue is not None
        first = await self.next()
        if first is None:
            return None
        joined: dict[str, tuple[SubState, str]] = {first[0].sub.rid: first}
        while not self._queue.empty() and not first[0].failed:
            out = self._queue.get_nowait()
            if out is None or out.error is not None:
                self._held.append(out)  # the disconnect or the failure is the next call's answer
                break
            s, delta = self._fold(out)
            prev = joined.get(s.sub.rid)
            joined[s.sub.rid] = (s, prev[1] + delta if prev is not None else delta)
        return list(joined.values())

    def _fold(self, out: ReqOutput) -> tuple[SubState, str]:
        s = self._by_rid[out.rid]
        first = not s.output_ids
        delta = s.apply(out)
        if out.new_token_ids:
            self._metrics.on_tokens(len(out.new_token_ids))
            if first:
                self._metrics.on_first_token(time.time() - self.req.arrival_time)
        if s.finished:
            self._metrics.on_inflight(-1)
        return s, delta

    def close(self) -> None:
        """Idempotent and synchronous: safe in ``finally`` of a cancelled task."""
        if self._closed:
            return
        self._closed = True
        if self._registry.get(self.req.rid) is self:
            del self._registry[self.req.rid]
        if self._watcher is not None:
            self._watcher.cancel()
        unfinished = [s for s in self.states if not s.finished]
        if self._abort_on_close:
            for s in unfinished:
                self.client.abort(s.sub.rid)
        self.client.unregister(list(self._by_rid))
        m = self._metrics
        m.on_inflight(-len(unfinished))
        m.on_request(self._endpoint, self.status)
        for s in self.states:
            if s.finished and not s.failed:
                timeline = s.timeline(self.req.arrival_time)
                m.on_sequence(s.prompt_tokens, s.cached_tokens, (timeline or {}).get("stages_ms", {}))
        m.on_e2e(time.time() - self.req.arrival_time)

    def abort_all(self) -> list[str]:
        rids = [s.sub.rid for s in self.states if not s.finished]
        for r in rids:
            self.client.abort(r)
        return rids


class _ClosingStream(StreamingResponse):
    """Closes the Inflight however the response ends, even if the body never started."""

    def __init__(self, content: AsyncIterator[bytes], inflight: Inflight) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._inflight = inflight

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._inflight.close()


async def serve(request: Request, req: ParsedRequest, client: SchedulerClient, tok: TokenizerLike,
                metrics: ApiMetrics, role: str, endpoint: str, registry: dict[str, Inflight]) -> Response:
    inflight = Inflight(client, req, tok, metrics, abort_on_close=(role == "decode"), endpoint=endpoint,
                        registry=registry)
    try:
        inflight.start(request)
    except DuplicateRid as exc:
        return error_response(400, str(exc))
    except SchedulerGone as exc:
        return error_response(503, f"the scheduler is unavailable: {exc}")
    response: Response | None = None
    try:
        response = await (_stream(inflight, tok) if req.stream else _whole(inflight, tok))
        return response
    finally:
        if not isinstance(response, _ClosingStream):  # a stream closes itself when it ends
            inflight.close()


async def _whole(inflight: Inflight, tok: TokenizerLike) -> Response:
    while not inflight.done:
        ev = await inflight.next()
        if ev is None:
            inflight.status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        s, _ = ev
        if s.failed:  # answer now; close() aborts the other sequences (decode role)
            inflight.status = s.http_status or 500
            return error_response(inflight.status, s.error or "generation failed")
    return JSONResponse(whole_body(inflight.req, inflight.states, tok))


async def _stream(inflight: Inflight, tok: TokenizerLike) -> Response:
    shaper = StreamShaper(inflight.req, tok)
    head: list[bytes] = []
    while not head:  # hold the status line until there is something to say
        ev = await inflight.next()
        if ev is None:
            inflight.status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        s, delta = ev
        if s.failed:
            inflight.status = s.http_status or 500
            return error_response(inflight.status, s.error or "generation failed")
        head = shaper.update(s, delta)

    async def body() -> AsyncIterator[bytes]:
        # One write per batch of events, not per frame: each write is a send() on the socket, and
        # on a loopback hop the kernel's receive path runs inside it, so with the frames of
        # several steps queued (a busy host) or a stream's last token, usage and [DONE] together,
        # joining them saves whole syscalls at the same latency (nothing waits for more).
        try:
            out = head
            while not inflight.done:
                if out:
                    yield b"".join(out)
                    out = []
                batch = await inflight.next_batch()
                if batch is None:
                    return
                for s, delta in batch:
                    if s.failed:
                        out.append(sse(error_body(s.http_status or 500, s.error or "generation failed")))
                        continue
                    out.extend(shaper.update(s, delta))
            tail = shaper.usage_chunk(inflight.states)
            if tail is not None:
                out.append(tail)
            out.append(DONE)
            yield b"".join(out)
        finally:
            inflight.close()

    return _ClosingStream(body(), inflight)


async def wait_finished(inflight: Inflight, timeout: float) -> bool:
    """For /health_generate: True if every sequence finished within ``timeout``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not inflight.done:
                if await inflight.next() is None:
                    return False
            return True
    return False
