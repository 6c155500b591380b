"""``pdcluster bench`` without a cluster: the request client against a scripted server, and the
report arithmetic against independent references (the CLI against a launched cluster is in
test_bench_cli).

    test_client_failures   every way a request can fail (HTTP error, SSE error chunk, early end,
                           timeout, refused connection) is counted with its reason, none raises
    the rest               percentiles vs numpy, stream timing, SSE framing, workload, leak check,
                           goodput, Prometheus counters as the node's own renderer writes them
"""
from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest
from aiohttp import web

from common.server.metrics import scheduler_gauges
from common.tools import bench_report as report
from common.tools.bench_run import run_requests
from common.tools.bench_client import RequestResult, StreamTimer, Target, sse_events
from common.tools.bench_workload import arrival_offsets, length_bounds, make_workload

pytestmark = pytest.mark.integration


# ---- the client against a scripted server ---------------------------------------------------------


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _scripted_pair() -> tuple[web.AppRunner, str]:
    """One server playing both nodes; the decode behaviour is chosen by max_new_tokens."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        is_prefill = request.path.startswith("/p/")
        if is_prefill:
            if n == 6:
                return web.json_response({"error": {"message": "KV transfer failed for room 12345678"}}, status=500)
            return web.Response(body=_sse({"output_ids": [], "meta_info": {"finish_reason": {"type": "length"}}})
                                + b"data: [DONE]\n\n", content_type="text/event-stream")
        if n == 2:
            return web.json_response({"error": {"message": "no KV pages for room 99999999"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids: list[int] = []
        for i in range(n):
            if n == 3 and i == 1:
                await resp.write(_sse({"error": {"message": "decode aborted"}}))
                return resp
            if n == 4 and i == 2:
                return resp  # connection closes without [DONE]
            if n == 5 and i == 0:
                await asyncio.sleep(2.5)  # past the request timeout
            ids.append(i)
            finish = {"type": "length"} if i == n - 1 else None
            await resp.write(_sse({"output_ids": list(ids), "meta_info": {"finish_reason": finish}}))
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/p/generate", generate)
    app.router.add_post("/d/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_client_failures() -> None:
    from common.tools.bench_workload import BenchRequest

    async def go() -> tuple[list[RequestResult], list[RequestResult], list[RequestResult]]:
        runner, base = await _scripted_pair()
        try:
            reqs = [BenchRequest(i, [1, 2, 3], n, 0.0) for i, n in enumerate((8, 2, 3, 4, 5, 6, 1))]
            target = Target(prefill=base + "/p", decode=base + "/d", bootstrap_host="127.0.0.1", bootstrap_port=1)
            res, _ = await run_requests(target, reqs, 4, 1.0, 20.0)
            # Through a router only its stream counts: the scripted decode plays the router.
            res_router, _ = await run_requests(Target(url=base + "/d"), reqs, 4, 1.0, 20.0)
            dead = Target(prefill="http://127.0.0.1:9", decode="http://127.0.0.1:9", bootstrap_host="127.0.0.1",
                          bootstrap_port=1)  # discard port: refused
            res_dead, _ = await run_requests(dead, reqs[:1], None, 1.0, 20.0)
            return res, res_router, res_dead
        finally:
            await runner.cleanup()

    res, res_router, res_dead = asyncio.run(go())
    by_len = {r.output_len: r for r in res}
    assert by_len[8].ok and by_len[8].output_tokens == 8 and len(by_len[8].itl_s) == 7
    assert by_len[1].ok and by_len[1].tpot_s is None and by_len[1].itl_s == []
    assert not by_len[2].ok and by_len[2].error == "decode HTTP 503: no KV pages for room 99999999"
    assert not by_len[3].ok and by_len[3].error == "stream error: decode aborted"
    assert not by_len[4].ok and by_len[4].error == "decode stream closed without [DONE]"
    assert not by_len[5].ok and "request timeout (1 s)" in by_len[5].error
    assert not by_len[6].ok and by_len[6].error.startswith("prefill HTTP 500: KV transfer failed")
    assert not res_dead[0].ok and res_dead[0].error.startswith("connection:")
    s = report.summarize(res, 1.0)
    assert s["completed"] == 2 and s["failed"] == 5 and sum(s["failure_reasons"].values()) == 5
    assert "decode HTTP 503: no KV pages for room <n>" in s["failure_reasons"]
    by_len = {r.output_len: r for r in res_router}
    assert [n for n, r in sorted(by_len.items()) if r.ok] == [1, 6, 8]  # no prefill leg: 6 succeeds
    assert by_len[2].error == "server HTTP 503: no KV pages for room 99999999"
    assert by_len[4].error == "server stream closed without [DONE]" and by_len[8].output_tokens == 8
    assert all(r.prefill_s is None for r in res_router)


# ---- pure parts -------------------------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    d = report.distribution_ms([0.001, 0.002, 0.010])
    assert d is not None and d["mean"] == pytest.approx(13 / 3, abs=1e-3) and d["max"] == 10.0
    assert report.distribution_ms([]) is None


def test_stream_timer_spreads_multi_token_chunks() -> None:
    t = StreamTimer(t0=10.0)
    t.on_event(10.5, {"output_ids": [7], "meta_info": {"finish_reason": None}})
    t.on_event(10.6, {"output_ids": [7], "meta_info": {}})  # no new token: no sample
    t.on_event(10.8, {"output_ids": [7, 8, 9, 4], "meta_info": {}})  # 3 tokens in one chunk
    t.on_event(10.9, {"output_ids": [7, 8, 9, 4, 5], "meta_info": {"finish_reason": {"type": "length"}}})
    assert t.ttft_s == pytest.approx(0.5) and t.tokens == 5 and t.finish_reason == "length"
    assert t.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_stream_timer_keeps_what_the_answer_says_of_its_prompt() -> None:
    """The prefill's cached tokens and the decode's reused ones, from the native meta_info (every
    frame carries them; the last one holds) or the OpenAI usage's prompt_tokens_details; a server
    that says nothing leaves None, and a value that is not a count is ignored."""
    t = StreamTimer(t0=0.0)
    t.on_event(0.1, {"output_ids": [1], "meta_info": {"cached_tokens": 32, "decode_reused_tokens": 16}})
    t.on_event(0.2, {"output_ids": [1, 2], "meta_info": {"cached_tokens": 48, "decode_reused_tokens": "x"}})
    assert (t.cached_tokens, t.decode_reused_tokens) == (48, 16)
    t = StreamTimer(t0=0.0)
    t.on_event(0.1, {"choices": [{"text": " a"}], "usage": {"completion_tokens": 1,
                                                              "prompt_tokens_details": {"cached_tokens": 7}}})
    assert (t.cached_tokens, t.decode_reused_tokens) == (7, None)
    t = StreamTimer(t0=0.0)
    t.on_event(0.1, {"output_ids": [1], "meta_info": {"cached_tokens": True, "decode_reused_tokens": -1}})
    assert (t.cached_tokens, t.decode_reused_tokens) == (None, None)


def test_stream_timer_reads_openai_completion_chunks() -> None:
    def chunk(text: str, usage: int | None = None, finish: str | None = None) -> dict:
        ev: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        if usage is not None:
            ev["usage"] = {"completion_tokens": usage}
        return ev

    # vllm-style: usage on every chunk (continuous_usage_stats), so counts are exact.
    t = StreamTimer(t0=0.0)
    t.on_event(0.2, chunk(" a", 1))
    t.on_event(0.3, chunk(" b c", 3))
    t.on_event(0.4, chunk("", 3))  # no new token
    t.on_event(0.5, chunk(" d", 4, "length"))
    assert t.ttft_s == pytest.approx(0.2) and t.tokens == 4 and t.finish_reason == "length"
    assert t.itl_s == pytest.approx([0.05, 0.05, 0.2])
    # Without per-chunk usage: one token per text chunk, the include_usage chunk sets the total.
    t = StreamTimer(t0=0.0)
    t.on_event(0.1, chunk(" a"))
    t.on_event(0.2, chunk(""))
    t.on_event(0.3, chunk(" b", finish="length"))
    t.on_event(0.31, {"choices": [], "usage": {"completion_tokens": 5}})
    assert t.ttft_s == pytest.approx(0.1) and t.itl_s == pytest.approx([0.2]) and t.tokens == 5
    with pytest.raises(Exception, match="stream error: boom"):
        t.on_event(0.4, {"error": {"message": "boom"}})


def test_sse_framing_across_reads() -> None:
    buf = bytearray()
    stream = _sse({"a": 1}) + b": comment\n\n" + _sse({"b": 2}) + b"data: [DONE]\n\n"
    got: list[bytes] = []
    for i in range(0, len(stream), 5):  # arbitrary read boundaries
        buf += stream[i:i + 5]
        got += sse_events(buf)
    assert [json.loads(g) if g != b"[DONE]" else g for g in got] == [{"a": 1}, {"b": 2}, b"[DONE]"]
    assert buf == bytearray()


def test_workload_bounds_determinism_and_rate() -> None:
    a = make_workload(200, 100, 20, 0.25, 50, 4.0, seed=5)
    assert a == make_workload(200, 100, 20, 0.25, 50, 4.0, seed=5)
    assert a != make_workload(200, 100, 20, 0.25, 50, 4.0, seed=6)
    assert all(25 <= r.input_len <= 100 and 5 <= r.output_len <= 20 for r in a)
    assert all(0 <= t < 50 for r in a for t in r.input_ids)
    assert {r.input_len for r in a} != {100}
    assert length_bounds(10, 1.0) == (10, 10) and length_bounds(10, 0.0) == (1, 10)
    offs = arrival_offsets(random.Random(1), 4000, 8.0)
    assert offs[0] == 0 and all(x <= y for x, y in zip(offs, offs[1:]))
    assert offs[-1] / (len(offs) - 1) == pytest.approx(1 / 8.0, rel=0.05)  # mean gap of a Poisson process
    assert arrival_offsets(random.Random(1), 3, math.inf) == [0.0, 0.0, 0.0]


IDLE_PREFILL = {"page_size": 16, "total_pages": 100, "free_pages": 100, "cached_pages": 0, "evictable_pages": 0,
                "locked_pages": 0, "used_pages": 0, "total_req_slots": 8, "free_req_slots": 8, "held_pages": 0,
                "transfer_rooms": 0, "live_reqs": 0}
IDLE_DECODE = {"page_size": 16, "total_pages": 100, "free_pages": 100, "total_req_slots": 8, "free_req_slots": 8,
               "aux_total_slots": 8, "aux_free_slots": 8, "num_running": 0, "new_token_ratio": 0.7,
               "integrity": "ok"}


def test_leak_check() -> None:
    cached = {**IDLE_PREFILL, "free_pages": 90, "cached_pages": 10, "evictable_pages": 10}
    assert report.leak_check(IDLE_PREFILL, cached) == []  # the prefix cache may keep evictable pages
    assert report.leak_check(IDLE_DECODE, {**IDLE_DECODE, "new_token_ratio": 0.5}) == []
    held = {**IDLE_PREFILL, "free_pages": 98, "held_pages": 2, "live_reqs": 1}
    assert len(report.leak_check(IDLE_PREFILL, held)) == 3
    assert report.leak_check(IDLE_DECODE, {**IDLE_DECODE, "aux_free_slots": 7}) == ["aux_free_slots 7 != aux_total_slots 8"]
    assert report.leak_check(IDLE_DECODE, {**IDLE_DECODE, "integrity": "AssertionError: x"}) == ["integrity: AssertionError: x"]
    locked = {**IDLE_PREFILL, "free_pages": 90, "cached_pages": 10, "evictable_pages": 8, "locked_pages": 2}
    assert len(report.leak_check(IDLE_PREFILL, locked)) == 2
    assert report.leak_check(IDLE_PREFILL, {**IDLE_PREFILL, "total_pages": 90, "free_pages": 90}) == ["total_pages: 100 -> 90"]


def test_goodput_and_summary() -> None:
    def r(i: int, ttft: float, e2e: float, n: int) -> RequestResult:
        return RequestResult(i, 10, n, ok=True, ttft_s=ttft, e2e_s=e2e, output_tokens=n,
                             itl_s=[(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else [])
    res = [r(0, 0.1, 1.1, 11), r(1, 0.5, 0.7, 3), r(2, 0.2, 0.2, 1),
           RequestResult(3, 10, 5, error="decode HTTP 503: x")]
    s = report.summarize(res, 2.0, slo_ttft_ms=300, slo_tpot_ms=50)
    # r0: TPOT 100 ms misses; r1: TTFT 500 ms misses; r2: one token, TTFT 200 ms meets.
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["request_goodput"] == 0.5
    assert s["completed"] == 3 and s["failed"] == 1 and s["total_output_tokens"] == 15
    assert s["requested_output_tokens"] == 20 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == 7.5 and s["concurrency"] == pytest.approx(1.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # samples 100 and 100: r2 has no TPOT
    assert len([x for q in res for x in q.itl_s if q.ok]) == 12
    assert report.format_report(s).count("\n") > 10


def test_scheduler_counters_from_node_renderer() -> None:
    labels = {"role": "prefill", "model_name": 'm"x'}
    before = report.scheduler_counters(scheduler_gauges({"forwards_total": 3.0, "token_usage": 0.5}, labels))
    after = report.scheduler_counters(scheduler_gauges({"forwards_total": 10.0, "prompt_tokens_total": 40,
                                                        "token_usage": 0.1}, labels))
    assert before == {"forwards_total": 3.0}
    assert report.counter_deltas(before, after) == {"forwards_total": 7.0, "prompt_tokens_total": 40.0}


def test_decode_step_split_from_counter_deltas() -> None:
    deltas = {"decode_steps_total": 200.0, "decode_batch_reqs_total": 3000.0, "decode_forward_seconds_total": 0.5,
              "decode_step_seconds_total": 0.8}
    split = report.decode_step_split(deltas)
    assert split == {"steps": 200.0, "mean_batch": 15.0, "forward_ms_per_step": 2.5, "step_ms_per_step": 4.0,
                     "overhead_ms_per_step": 1.5}
    assert "overhead 1.50 ms/step" in report.format_step_split(split)
    old_node = report.decode_step_split({k: v for k, v in deltas.items() if k != "decode_step_seconds_total"})
    assert old_node == {"steps": 200.0, "mean_batch": 15.0, "forward_ms_per_step": 2.5}
    assert "overhead" not in report.format_step_split(old_node)
    assert report.decode_step_split({"forwards_total": 3.0}) is None  # a prefill node
