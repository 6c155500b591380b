"""The router's live page (router/dashboard.py) on loopback, in front of scripted nodes that
answer /debug/memory and /metrics like ours, plus a dead one and a hung one.

    test_data_lists_every_worker_with_its_numbers   queues, KV pages, throughput from the nodes; TTFT
                                                    and TPOT from the router's own streams; the dead
                                                    and the hung node are listed with why, in bounded time
    test_page_is_self_contained_html                 /dashboard is the packaged page, allowed to talk
                                                    only to its own origin

The e2e tier (tests/e2e/test_dashboard.py) loads the page in headless Chromium over real nodes.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from common.server.metrics import ApiMetrics
from router import dashboard
from router.app import create_app
from router.config import parse_config
from tests.e2e.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FRAMES = 5
FRAME_GAP_S = 0.02
PREFILL_MEM = {"page_size": 16, "total_pages": 100, "free_pages": 70, "cached_pages": 20, "used_pages": 10,
               "bootstrap_reqs": 1, "waiting_reqs": 2, "chunked_reqs": 0, "parked_reqs": 5, "inflight_reqs": 3,
               "transfer_rooms": 4}
DECODE_MEM = {"page_size": 16, "total_pages": 200, "free_pages": 150, "cached_pages": 0, "used_pages": 50,
              "num_prealloc": 1, "num_transfer": 2, "num_waiting": 0, "num_running": 5, "num_retracted": 0,
              "num_draining": 0, "transfer_rooms": 3, "integrity": "ok"}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def _node(role: str, mem: dict, *, health_status: int = 200, hang_s: float = 0.0) -> web.Application:
    """A scripted node: generation answers like ours (a stream of FRAMES frames, FRAME_GAP_S apart),
    /metrics is a real ApiMetrics page with scheduler gauges."""

    async def gen(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"text": "", "meta_info": {}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(FRAMES):
            await resp.write(b"data: " + json.dumps({"text": str(i)}).encode() + b"\n\n")
            await asyncio.sleep(FRAME_GAP_S)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=health_status)

    async def load(_: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])

    async def memory(_: web.Request) -> web.Response:
        await asyncio.sleep(hang_s)
        return web.json_response(mem)

    async def metrics(_: web.Request) -> web.Response:
        await asyncio.sleep(hang_s)
        page = ApiMetrics(role, "m").render({"gen_throughput": 123.5, "num_running_reqs": 5.0})
        return web.Response(body=page, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/generate", gen)
    app.router.add_get("/health", health)
    app.router.add_get("/get_load", load)
    app.router.add_get("/debug/memory", memory)
    app.router.add_get("/metrics", metrics)
    return app


@asynccontextmanager
async def _cluster() -> AsyncIterator[tuple[str, dict[str, str], aiohttp.ClientSession]]:
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()
    try:
        urls: dict[str, str] = {}
        for name, app in (("prefill", _node("prefill", PREFILL_MEM)), ("decode", _node("decode", DECODE_MEM)),
                          ("hung", _node("decode", DECODE_MEM, health_status=503, hang_s=30))):
            runner, urls[name] = await _serve(app)
            runners.append(runner)
        urls["dead"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        argv = ["--health-check-interval-s", "0.1", "--load-poll-interval-s", "0.1", "--prefill", urls["prefill"], "9000"]
        for name in ("decode", "hung", "dead"):
            argv += ["--decode", urls[name]]
        runner, url = await _serve(create_app(parse_config(argv)))
        runners.insert(0, runner)
        async with asyncio.timeout(10):
            while True:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
        yield url, urls, session
    finally:
        await session.close()
        for runner in runners:
            await runner.cleanup()


def test_data_lists_every_worker_with_its_numbers() -> None:
    async def body() -> None:
        async with _cluster() as (url, nodes, session):
            for i in range(3):
                async with session.post(url + "/generate", json={"text": f"hi {i}", "stream": True}) as r:
                    assert r.status == 200
                    assert (await r.read()).endswith(b"data: [DONE]\n\n")
            t0 = time.monotonic()
            async with session.get(url + "/dashboard/data") as r:
                assert r.status == 200
                data = await r.json()
            took = time.monotonic() - t0
            assert took < dashboard.FETCH_TIMEOUT_S + 1.0, f"a hung node held the page {took:.1f} s"
            assert data["cluster"] == {"status": "ok", "healthy_prefill": 1, "healthy_decode": 1, "inflight_rooms": 0}
            rows = {w["url"]: w for w in data["workers"]}
            assert set(rows) == set(nodes.values())

            p, d = rows[nodes["prefill"]], rows[nodes["decode"]]
            assert (p["role"], p["healthy"], p["reachable"], p["error"]) == ("prefill", True, True, None)
            assert p["queues"] == [["bootstrap", 1], ["waiting", 2], ["chunked", 0], ["parked", 5], ["transferring", 3]]
            assert (p["transfers"], p["transfer_rooms"], p["running"]) == (3, 4, 8)
            assert p["kv"]["usage"] == pytest.approx(0.3) and p["kv"]["cached_pages"] == 20
            assert p["throughput"] == 123.5 and p["scheduler_up"] is True
            assert p["ttft"]["n"] == 3 and p["tpot"]["n"] == 0  # the prefill's TPOT is the decode's
            assert d["queues"][3] == ["running", 5] and d["transfers"] == 2 and d["kv"]["usage"] == 0.25
            assert d["routed"] == 3 and d["ttft"]["n"] == 3 and d["tpot"]["n"] == 3
            # FRAMES frames FRAME_GAP_S apart: about one gap per token (the loop is slower, never faster).
            assert FRAME_GAP_S * 0.8 <= d["tpot"]["p50"] < FRAME_GAP_S * 5
            assert 0 < d["ttft"]["p50"] <= d["ttft"]["p90"] < 2

            dead, hung = rows[nodes["dead"]], rows[nodes["hung"]]
            assert (dead["healthy"], dead["reachable"], dead["kv"], dead["ttft"]["n"]) == (False, False, None, 0)
            assert "/debug/memory" in dead["error"] and "ClientConnectorError" in dead["error"]
            assert hung["healthy"] is False and hung["reachable"] is False
            assert "no answer within" in hung["error"]

            # A second page within MIN_INTERVAL_S shares the gather instead of asking the nodes again.
            async with session.get(url + "/dashboard/data") as r:
                assert (await r.json())["generated_at"] == data["generated_at"]

    asyncio.run(body())


def test_page_is_self_contained_html() -> None:
    async def body() -> None:
        async with _cluster() as (url, _, session):
            async with session.get(url + "/dashboard") as r:
                assert r.status == 200 and r.content_type == "text/html"
                csp = r.headers["Content-Security-Policy"]
                page = await r.text()
            assert "connect-src 'self'" in csp and "default-src 'none'" in csp
            assert "<script>" in page and "/data" in page
            assert "http://" not in page and "https://" not in page  # nothing from elsewhere

    asyncio.run(body())
