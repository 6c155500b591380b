"""One client request through the cluster: pick a pair, send both legs, answer, retry.

    for each try (at most 1 + max_retries, none started after retry_budget_s):
      pick D (decode policy) and P (prefill policy) among healthy workers   none: 503
        a first try whose D holds all but a few of the prompt's tokens (--decode-local-prefill-tokens,
        exact cache-aware decode pick): no P, no room; D alone gets the body and computes the rest
      reserve rooms (one per sequence)            released when the try ends, on every path
      POST P and D at once: the same body + bootstrap_host/port/room; P is asked for JSON
      wait for the answers' status (D's status line, which a streaming node sends only with its
      first output, so only once the KV arrived; for a JSON answer also P's whole body):
        a connection error          -> that worker leaves rotation; try again
        a 5xx from either           -> try again, preferring other workers
        a 4xx                       -> the client gets it as it is (bad input fails everywhere)
        D 200 (and P 200 for JSON)  -> committed: no retry from here on
      stream: D's SSE frames are written to the client as they arrive; if D dies mid-stream the
              client gets an SSE error event and [DONE], not a hang
      JSON:   D's body (with P's input logprobs merged in for /generate), once it is whole
    the request timeout bounds all of it (504); a client that disconnects cancels the handler,
    which closes both legs, and the nodes abort the request and free what it held.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from common.pd_contract import BOOTSTRAP_FIELDS
from router.metrics import RouterMetrics, stream_tokens
from router.parse import RequestInfo, RouterError, bootstrap_fields
from router.policies import Policy
from router.prompt_key import RouteKey
from router.rooms import Rooms
from router.timeline import Marks, rewrite_body, rewrite_frames
from router.workers import Worker, Workers

log = logging.getLogger("router.forward")

# How long a stream's last frame (the one carrying the timeline) waits for the prefill's answer.
PREFILL_ANSWER_WAIT_S = 0.2
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)
# Prompt + completion tokens of an answered request, as the nodes reported them; set on success
# only (the handler settles the client's token bucket with it, router/clients.py).
USAGE = web.RequestKey("usage", float)


def error_body(status: int, message: str) -> dict:
    """The nodes' error shape (OpenAI's), so clients parse one kind of error."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
            429: "RateLimitError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
            504: "GatewayTimeoutError"}.get(status, "Error")
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message), status=status, headers=headers)


@dataclass
class Failure:
    """Why one try failed, and whether another may follow."""

    reason: str
    retryable: bool
    blame: tuple[Worker, ...] = ()  # prefer other workers next time
    response: web.Response | None = None  # the client's answer as it is (a node's 4xx, a 504)
    kind: str = "node_5xx"  # the errors metric's reason label


@dataclass(frozen=True)
class ForwardConfig:
    request_timeout_s: float
    max_retries: int
    retry_budget_s: float
    decode_local_prefill_tokens: int = 0  # router/config.py


class Forwarder:
    def __init__(self, workers: Workers, policies: dict[str, Policy], rooms: Rooms, session: aiohttp.ClientSession,
                 cfg: ForwardConfig, metrics: RouterMetrics) -> None:
        self._workers = workers
        self._policies = policies
        self._rooms = rooms
        self._session = session
        self._cfg = cfg
        self._metrics = metrics

    # ---- the request ---------------------------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: str, body: dict, info: RequestInfo,
                     key: RouteKey | None = None) -> web.StreamResponse:
        """``key``: the prompt as token ids too (a router with a tokenizer); else its text key."""
        t0 = time.monotonic()
        route: RouteKey | str | None = key if key is not None else info.key
        marks = Marks(arrival=t0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._cfg.request_timeout_s
        avoid: set[str] = set()
        failure: Failure | None = None
        for attempt in range(self._cfg.max_retries + 1):
            if attempt:
                if time.monotonic() - t0 > self._cfg.retry_budget_s:
                    break
                self._metrics.retries.labels(endpoint).inc()
            try:
                # The decode gets the prompt key too: with --decode-policy cache-aware a conversation's
                # next turn goes where its last one did, whose decode prefix cache may hold it.
                d = self._pick("decode", route, avoid)
                p = None if attempt == 0 and self._local(endpoint, body, info, key, d) else \
                    self._pick("prefill", route, avoid)
            except RouterError as exc:
                if failure is None:
                    return self._finish(endpoint, t0, error_response(exc.status, exc.message), "no_worker")
                break  # report the failure that emptied the rotation, not the empty rotation
            leg_body = self._with_rid(body, attempt)
            # The decode counts as busy for the whole request; the prefill only until it answers
            # (_prefill releases it): after that the request costs it nothing. Both count from the
            # pick on, before anything awaits: a burst's requests are all picked before any of
            # their legs runs, and each pick must see the ones before it (else the whole burst
            # looks at idle workers and lands on one).
            release_prefill, prefill_computed = self._hold_prefill(p, key) if p is not None else (_nothing, _nothing)
            rooms = self._rooms.hold(info.sequences) if p is not None else contextlib.nullcontext(None)
            try:
                with self._workers.busy(d), rooms as room:
                    if p is not None:
                        self._policies["prefill"].on_routed(p, route)
                    else:
                        self._metrics.decode_local.labels(endpoint).inc()
                    self._policies["decode"].on_routed(d, route)
                    result = await self._try(request, endpoint, leg_body, info, p, d, room, marks, deadline,
                                             release_prefill, key, prefill_computed=prefill_computed)
            finally:
                release_prefill()  # a prefill leg that never ran (idempotent)
            if not isinstance(result, Failure):
                return result
            failure = result
            log.info("try %d of %s via %s + %s failed: %s", attempt + 1, endpoint, p.url if p else "(no prefill)", d.url,
                     failure.reason)
            if failure.response is not None:
                return self._finish(endpoint, t0, failure.response, failure.kind)
            if not failure.retryable:
                break
            avoid.update(w.url for w in failure.blame)
        assert failure is not None
        return self._finish(endpoint, t0, error_response(502, f"the request failed on every try: {failure.reason}"),
                            "exhausted")

    def _local(self, endpoint: str, body: dict, info: RequestInfo, key: RouteKey | None, d: Worker) -> bool:
        """Whether ``d`` should compute this prompt alone: it holds all but at most
        ``decode_local_prefill_tokens`` of its tokens (the exact decode pick's prediction, so its
        KV events are in sync). That is a conversation's next turn on the decode that ran its last
        one: without the prefill's queue, forward and transfer its first token comes after one
        short extend there. One sequence only (a room pairs each of several), and no prompt
        logprobs (the prefill computes those)."""
        limit = self._cfg.decode_local_prefill_tokens
        if not limit or key is None or key.tokens is None or info.sequences != 1:
            return False
        if endpoint == "generate" and body.get("return_logprob"):
            return False
        hit = key.decode_predicted.get(d.url)
        return hit is not None and len(key.tokens) - hit <= limit

    def _pick(self, role: str, key: RouteKey | str | None, avoid: set[str]) -> Worker:
        candidates = self._workers.candidates(role)
        if not candidates:
            raise RouterError(503, f"no healthy {role} node: the cluster cannot serve requests now")
        preferred = [w for w in candidates if w.url not in avoid] or candidates
        return self._policies[role].pick(preferred, key)

    @staticmethod
    def _with_rid(body: dict, attempt: int) -> dict:
        """A client's rid is kept; a retry suffixes it, since the first try's prefill may still run it."""
        rid = body.get("rid")
        if attempt == 0 or rid is None:
            return body
        if isinstance(rid, list):
            return {**body, "rid": [f"{r}-retry{attempt}" for r in rid]}
        return {**body, "rid": f"{rid}-retry{attempt}"}

    def _stage_observer(self, endpoint: str) -> Callable[[dict], None]:
        def observe(timeline: dict) -> None:
            for stage, ms in timeline["stages_ms"].items():
                self._metrics.stage.labels(endpoint, stage).observe(ms / 1000.0)
        return observe

    def _finish(self, endpoint: str, t0: float, resp: web.StreamResponse, reason: str | None = None) -> web.StreamResponse:
        self._metrics.requests.labels(endpoint, str(resp.status)).inc()
        if resp.status >= 400 and reason is not None:
            self._metrics.errors.labels(endpoint, reason).inc()
        self._metrics.latency.labels(endpoint).observe(time.monotonic() - t0)
        return resp

    # ---- one try -------------------------------------------------------------------------------

    async def _try(self, request: web.Request, endpoint: str, body: dict, info: RequestInfo, p: Worker | None,
                   d: Worker, room: int | None, marks: Marks, deadline: float, release_prefill: Callable[[], None],
                   key: RouteKey | None = None, *,
                   prefill_computed: Callable[[], None]) -> web.StreamResponse | Failure:
        """One try on ``p`` + ``d``, or on ``d`` alone (``p`` None: a local request, no room)."""
        t0 = marks.arrival
        path = PATHS[endpoint]
        prefill: asyncio.Task | None = None
        if p is None:  # no bootstrap fields: the decode computes the prompt itself
            dbody = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
        else:
            assert room is not None
            boot = bootstrap_fields(info, p.host, p.bootstrap_port, room)
            pbody = {**body, **boot, "stream": False}
            pbody.pop("stream_options", None)
            dbody = {**body, **boot}
        marks.sent = time.monotonic()
        if p is not None:
            prefill = asyncio.create_task(self._prefill(p, path, pbody, deadline, release_prefill, endpoint, info, key))
        decode = asyncio.create_task(self._open(d, path, dbody))
        legs = [t for t in (prefill, decode) if t is not None]
        d_resp: aiohttp.ClientResponse | None = None
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    pending: set[asyncio.Task] = set(legs)
                    p_answer: dict | list | None = None
                    # A stream commits on the decode's 200 alone: its status line comes with its
                    # first output, which needs the KV, so the prefill's part is done by then.
                    while d_resp is None or (not info.stream and prefill in pending):
                        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                        for task in done:
                            outcome = task.result()
                            if isinstance(outcome, Failure):
                                return outcome
                            if task is decode:
                                d_resp = outcome
                            else:
                                p_answer = outcome
                    assert d_resp is not None
                    if info.stream:
                        prefill_computed()  # the decode's 200 came with the first token: the prompt is computed
                    self._decode_prediction(d, info, key)
                    if not info.stream:
                        try:
                            raw = await d_resp.read()
                            final_in = time.monotonic()
                        except _CONNECTION_ERRORS as exc:
                            self._workers.mark_failed(d, f"{type(exc).__name__}: {exc}")
                            return Failure(f"decode {d.url} broke off its answer: {type(exc).__name__}", True, (d,))
                        out = _merge_input_logprobs(endpoint, raw, p_answer)
                        out = rewrite_body(out, marks, final_in, p_answer, self._stage_observer(endpoint))
                        self._metrics.ttft.labels(endpoint).observe(time.monotonic() - t0)
                        resp = web.Response(body=out, status=200, content_type="application/json")
                        with contextlib.suppress(ValueError):
                            answer = json.loads(out)
                            used = reported_usage(answer)
                            if used is not None:
                                request[USAGE] = used
                            self._decode_reported(d, info, key, endpoint, answer)
                        return self._finish(endpoint, t0, resp)
            except TimeoutError:
                msg = f"no complete answer within the router's request timeout ({self._cfg.request_timeout_s:g} s)"
                return Failure(msg, False, response=error_response(504, msg), kind="timeout")
            resp = await self._pipe(request, endpoint, p, d, d_resp, marks, prefill, deadline, info.sequences,
                                    lambda last: self._decode_reported(d, info, key, endpoint, last))
            # The prefill answers about when the first token exists; wait for it (bounded by its
            # deadline) so its in-flight count and the rooms are released only once it is done.
            if prefill is not None:
                await asyncio.gather(prefill, return_exceptions=True)
            return resp
        finally:
            for task in legs:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*legs, return_exceptions=True)
            if decode.done() and not decode.cancelled() and isinstance(decode.result(), aiohttp.ClientResponse):
                decode.result().close()  # not read to its end (a failure, a disconnect): drop the connection

    def _hold_prefill(self, p: Worker, key: RouteKey | None) -> tuple[Callable[[], None], Callable[[], None]]:
        """Count ``p`` busy, and with token ids the tokens it must compute as queued on it.
        Returns (release, computed), both idempotent: ``release`` ends both counts when the leg
        ends, however it ends; ``computed`` ends the queued tokens alone, sooner, when the router
        knows the prompt is computed: a stream's decode answered 200, which it does with the first
        token, so the KV is in its pages. The prefill's own answer comes later: it notices the
        transfer's end between two forwards, on a CPU one more forward of seconds, and tokens
        still counted as queued meanwhile steer the exact pick away from the prefill that holds
        the conversation (measured: 1-3 of 24 turns moved to the other prefill, each a miss)."""
        predicted = key.predicted.get(p.url) if key is not None and key.tokens is not None else None
        queued = len(key.tokens) - (predicted or 0) if key is not None and key.tokens is not None else 0
        p.queued_tokens += queued
        release_busy = self._workers.hold(p)

        def computed() -> None:
            nonlocal queued
            p.queued_tokens -= queued
            queued = 0

        def release() -> None:
            computed()
            release_busy()

        return release, computed

    async def _prefill(self, p: Worker, path: str, body: dict, deadline: float, release: Callable[[], None],
                       endpoint: str = "", info: RequestInfo | None = None,
                       key: RouteKey | None = None) -> dict | list | None | Failure:
        """The prefill node's whole answer (its KV is in the decode's pages by then), or why not;
        ``release`` ends its count as busy (``_hold_prefill``). Its reported cache hit is compared
        with the prediction (``pdc_router_kv_predictions``)."""
        predicted = key.predicted.get(p.url) if key is not None and key.tokens is not None else None
        try:
            async with asyncio.timeout_at(deadline), self._session.post(p.url + path, json=body) as r:
                raw = await r.read()
                status = r.status
        except TimeoutError:
            return Failure(f"prefill {p.url} did not answer before the request's deadline", False)
        except _CONNECTION_ERRORS as exc:
            self._workers.mark_failed(p, f"{type(exc).__name__}: {exc}")
            return Failure(f"prefill {p.url}: {type(exc).__name__}: {exc}", True, (p,))
        finally:
            release()
        answer = _judge("prefill", p, status, raw)
        if predicted is not None and info is not None and info.sequences == 1 and not isinstance(answer, Failure):
            reported = reported_cached_tokens(endpoint, answer)
            if reported is not None:
                self._metrics.prediction(predicted, reported)
                if predicted != reported:
                    log.debug("prefill %s: predicted %d cached tokens, it reported %d", p.url, predicted, reported)
        return answer

    def _decode_reported(self, d: Worker, info: RequestInfo, key: RouteKey | None, endpoint: str,
                         answer: object) -> None:
        """The decode's answer (or a stream's last frame) reports what it reused
        (``decode_reused_tokens``): compared with what was predicted for it, per request."""
        if key is None or key.tokens is None or info.sequences != 1:
            return
        predicted = key.decode_predicted.get(d.url)
        reported = reported_cached_tokens(endpoint, answer, "decode_reused_tokens")
        if predicted is not None and reported is not None:
            self._metrics.decode_prediction(predicted, reported)

    def _decode_prediction(self, d: Worker, info: RequestInfo, key: RouteKey | None) -> None:
        """The decode took the request (its 200): the prefix hit predicted for it is what it reused
        (it chose its cached prefix before answering), so the decode's
        ``pdc_decode_reused_tokens_total`` grows by the same (single-sequence requests only)."""
        if key is None or key.tokens is None or info.sequences != 1:
            return
        predicted = key.decode_predicted.get(d.url)
        if predicted is not None:
            self._metrics.kv_decode_predicted.inc(predicted)

    async def _open(self, d: Worker, path: str, body: dict) -> aiohttp.ClientResponse | Failure:
        """The decode's response once its status line is in (its body still to read), or why not."""
        try:
            r = await self._session.post(d.url + path, json=body)
        except _CONNECTION_ERRORS as exc:
            self._workers.mark_failed(d, f"{type(exc).__name__}: {exc}")
            return Failure(f"decode {d.url}: {type(exc).__name__}: {exc}", True, (d,))
        if r.status == 200:
            return r
        try:
            raw = await r.read()
        except _CONNECTION_ERRORS:
            raw = b""
        finally:
            r.release()
        judged = _judge("decode", d, r.status, raw)
        assert isinstance(judged, Failure)
        return judged

    async def _pipe(self, request: web.Request, endpoint: str, p: Worker | None, d: Worker,
                    d_resp: aiohttp.ClientResponse, marks: Marks, prefill: asyncio.Task | None, deadline: float,
                    sequences: int,
                    on_last: Callable[[dict], None]) -> web.StreamResponse:
        """Pass the decode's SSE stream on, frame by frame, as it arrives. Committed: a failure
        from here on reaches the client as an SSE error event, then [DONE]. ``on_last`` gets the
        last data frame of a stream that ended well."""
        t0 = marks.arrival
        observe = self._stage_observer(endpoint)
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        buf = bytearray()
        first, finished = True, False
        t_first = t_last = 0.0
        frames_sent, tail = 0, b""  # SSE frames ([DONE] included) and the last ones with data: for TPOT
        error: tuple[int, str, str] | None = None  # status, message, metric reason
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in d_resp.content.iter_any():
                    buf += chunk
                    end = buf.rfind(b"\n\n")
                    if end < 0:
                        continue
                    frames = bytes(buf[:end + 2])
                    del buf[:end + 2]
                    if prefill is not None and not prefill.done() and b'"timeline"' in frames:
                        # The last frame nests the prefill's timeline; its answer normally came long
                        # before, but a prefill busy in a forward may answer a moment after the KV landed.
                        await asyncio.wait({prefill}, timeout=PREFILL_ANSWER_WAIT_S)
                    p_answer = prefill.result() if prefill is not None and prefill.done() and not prefill.cancelled() \
                        else None
                    frames = rewrite_frames(frames, marks, p_answer, observe)
                    await _write_to_client(resp, frames)
                    t_last = time.monotonic()
                    frames_sent += frames.count(b"\n\n")
                    tail = frames if frames != DONE else tail
                    if first:
                        self._metrics.ttft.labels(endpoint).observe(t_last - t0)
                        self._metrics.recent.first_token((p.url, d.url) if p is not None else (d.url,), t_last - t0)
                        t_first, first = t_last, False
                    finished = frames.endswith(DONE)
            if not finished:
                raise ConnectionError("the stream closed before [DONE]")
        except TimeoutError:
            error = (504, f"the stream outlived the router's request timeout ({self._cfg.request_timeout_s:g} s)",
                     "timeout")
        except _CONNECTION_ERRORS as exc:
            self._workers.mark_failed(d, f"mid-stream: {type(exc).__name__}: {exc}")
            error = (502, f"the decode node {d.url} failed mid-stream: {type(exc).__name__}: {exc}",
                     "decode_mid_stream")
        except ClientGone:
            # The handler's finally closes the decode leg: the node aborts the request.
            error = (499, "the client closed the stream", "client_gone")
        status, msg, reason = error or (200, "", "")
        if error is not None:
            self._metrics.errors.labels(endpoint, reason).inc()
        else:
            self._metrics.recent.stream_ended(d.url, t_first, t_last, stream_tokens(tail, frames_sent - 1, sequences))
            used = stream_usage(tail, sequences)
            if used is not None:
                request[USAGE] = used
            last = last_frame(tail)
            if last is not None:
                on_last(last)
        with contextlib.suppress(ClientGone, ConnectionError):
            if error is not None and reason != "client_gone":
                await _write_to_client(resp, b"data: " + json.dumps(error_body(status, msg)).encode() + b"\n\n" + DONE)
            await resp.write_eof()
        self._finish(endpoint, t0, resp)
        return resp


def _nothing() -> None:
    """The prefill hold of a try without a prefill."""


class ClientGone(Exception):
    """The client closed its connection mid-stream: nothing more to tell it."""


async def _write_to_client(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone(str(exc)) from exc


def _judge(role: str, w: Worker, status: int, raw: bytes) -> dict | list | None | Failure:
    """A node's whole answer: the parsed body if 200, else the Failure it means."""
    if status == 200:
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None  # an SSE answer (a node asked for a stream anyway): only its status counts
    text = raw.decode(errors="replace")[:500]
    try:
        err = json.loads(raw)
        msg = str(err["error"]["message"]) if isinstance(err, dict) and isinstance(err.get("error"), dict) else text
    except ValueError:
        msg = text
    if status == 401:  # the client's key is the router's business: this is our cluster secret
        log.error("%s %s refuses the router's cluster secret: %s", role, w.url, msg)
        text = f"{role} {w.url} refused the router's credentials (401): check --cluster-secret"
        return Failure(text, False, response=error_response(502, text), kind="node_auth")
    if 400 <= status < 500:
        return Failure(f"{role} {w.url} refused the request ({status}): {msg}", False,
                       response=web.Response(body=raw, status=status, content_type="application/json"))
    return Failure(f"{role} {w.url} answered {status}: {msg}", True, (w,))


def reported_usage(answer: object) -> float | None:
    """Prompt + completion tokens a JSON answer reports (``usage`` on the OpenAI routes,
    ``meta_info`` per sequence on /generate, summed over a list), or None where any is missing."""
    if isinstance(answer, list):
        parts = [reported_usage(a) for a in answer]
        return None if not parts or any(p is None for p in parts) else float(sum(parts))  # type: ignore[arg-type]
    if not isinstance(answer, dict):
        return None
    for key in ("usage", "meta_info"):
        rec = answer.get(key)
        if isinstance(rec, dict):
            p, c = rec.get("prompt_tokens"), rec.get("completion_tokens")
            if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (p, c)):
                return float(p + c)  # type: ignore[operator]
    return None


def last_frame(frames: bytes) -> dict | None:
    """The last data frame of a stream's tail, parsed, or None."""
    data = [f for f in frames.split(b"\n\n") if f.startswith(b"data: ") and f != DONE.strip()]
    try:
        obj = json.loads(data[-1][6:]) if data else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def stream_usage(last_frames: bytes, sequences: int) -> float | None:
    """Prompt + completion tokens of a finished stream: its last data frame's ``usage`` (OpenAI
    with ``include_usage``: over every sequence), or its ``meta_info`` when there is one
    sequence (/generate frames state their own sequence's count); else None (unknown)."""
    obj = last_frame(last_frames)
    if obj is None or (not isinstance(obj.get("usage"), dict) and sequences != 1):
        return None
    return reported_usage(obj)


def reported_cached_tokens(endpoint: str, answer: object, field: str = "cached_tokens") -> int | None:
    """The cached prompt tokens a JSON answer reports (``meta_info`` on /generate,
    ``usage.prompt_tokens_details`` on the OpenAI routes), or None: ``cached_tokens`` (the
    prefill's hit) or ``decode_reused_tokens`` (a decode's own)."""
    if not isinstance(answer, dict):
        return None
    if endpoint == "generate":
        value = (answer.get("meta_info") or {}).get(field) if isinstance(answer.get("meta_info"), dict) else None
    else:
        usage = answer.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        value = details.get(field) if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _merge_input_logprobs(endpoint: str, raw: bytes, prefill: object) -> bytes:
    """/generate with return_logprob: the prompt's logprobs are computed on the prefill node, so
    the decode's meta_info lacks them; copy the prefill's ``input_*`` entries in (as sglang-router
    does). Anything else passes through byte for byte."""
    if endpoint != "generate" or prefill is None:
        return raw
    try:
        out = json.loads(raw)
    except ValueError:
        return raw
    pairs = list(zip(out, prefill)) if isinstance(out, list) and isinstance(prefill, list) else [(out, prefill)]
    changed = False
    for d_item, p_item in pairs:
        dm = d_item.get("meta_info") if isinstance(d_item, dict) else None
        pm = p_item.get("meta_info") if isinstance(p_item, dict) else None
        if not isinstance(dm, dict) or not isinstance(pm, dict):
            continue
        for k, v in pm.items():
            if k.startswith("input_") and "logprob" in k and v and not dm.get(k):
                dm[k] = v
                changed = True
    return json.dumps(out).encode() if changed else raw
