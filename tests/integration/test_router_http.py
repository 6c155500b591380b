"""The real router app on loopback in front of scripted workers (small aiohttp servers written
here, recording what they receive): the forwarding, streaming, retry, health and worker-set rules
of router/forward.py and router/workers.py, each with a case a broken router would fail.

The e2e tier (tests/e2e/test_router_cluster.py) runs the same router over real nodes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from common.auth import PROOF_HEADER, RequestVerifier, proof
from router.app import STATE, create_app
from router.config import parse_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

Handler = Callable[["Fake", web.Request, dict], Awaitable[web.StreamResponse]]


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def ok_prefill(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response({"text": "", "meta_info": {"id": "p", "input_token_logprobs": [[-1.5, 7, None]]}})


async def ok_decode(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response({"text": "abc", "output_ids": [1, 2, 3], "meta_info": {"id": "d"}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(sse({"output_ids": list(range(i + 1))}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@dataclass
class Fake:
    """One scripted worker: /health answers ``health`` (200), generation calls ``handler``."""

    handler: Handler
    health: int = 200
    received: list[dict] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a generation connection went away early
    other: list[str] = field(default_factory=list)  # paths of non-generation POSTs
    auth: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Authorization) of every request
    status: int = 200  # what every route but /health answers (401: a node refusing our credentials)
    secret: str | None = None  # a node of a secured cluster: answers the router's challenge, checks tokens
    verdicts: list[tuple[str, str | None]] = field(default_factory=list)  # (path, why its token was refused | None)
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> Fake:
        verifier = RequestVerifier(self.secret) if self.secret else None

        async def gen(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.received.append(body)
            try:
                return await self.handler(self, request, body)
            except (asyncio.CancelledError, ConnectionResetError):
                self.closed.set()
                raise

        async def health(request: web.Request) -> web.Response:
            challenge = request.query.get("challenge")
            headers = {PROOF_HEADER: proof(self.secret, challenge)} if self.secret and challenge else None
            return web.json_response({}, status=self.health, headers=headers)

        async def load(_: web.Request) -> web.Response:
            return web.json_response([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])

        async def post_other(request: web.Request) -> web.Response:
            self.other.append(request.path)
            return web.json_response({"success": True})

        @web.middleware
        async def record_auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
            self.auth.append((request.path, request.headers.get("Authorization")))
            if verifier is not None and request.path != "/health":
                self.verdicts.append((request.path, verifier.check(request.headers.get("Authorization"), request.method,
                                                                   request.raw_path, await request.read())))
            if self.status != 200 and request.path != "/health":
                return web.json_response({"error": {"message": "refused", "code": self.status}}, status=self.status)
            return await handler(request)

        app = web.Application(middlewares=[record_auth])
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        app.router.add_get("/health", health)
        app.router.add_get("/get_load", load)
        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m"}]})

        app.router.add_get("/v1/models", models)
        app.router.add_post("/flush_cache", post_other)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class Cluster:
    def __init__(self, prefills: list[Fake], decodes: list[Fake], runner: web.AppRunner, url: str,
                 session: aiohttp.ClientSession) -> None:
        self.prefills, self.decodes, self.runner, self.url, self.session = prefills, decodes, runner, url, session

    async def post(self, path: str, body: object) -> tuple[int, object]:
        async with self.session.post(self.url + path, json=body) as r:
            raw = await r.read()
            return r.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw

    async def workers(self) -> dict[str, dict]:
        async with self.session.get(self.url + "/workers") as r:
            return {w["url"]: w for w in (await r.json())["workers"]}

    async def wait_healthy(self, url: str, healthy: bool = True, timeout_s: float = 10) -> None:
        async with asyncio.timeout(timeout_s):
            while (await self.workers()).get(url, {}).get("healthy") is not healthy:
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router_over(prefills: list[Handler], decodes: list[Handler], *flags: str,
                      healthy: bool = True, headers: dict[str, str] | None = None,
                      ssl_context: object = None, client_ssl: object = None) -> AsyncIterator[Cluster]:
    """Scripted workers with the real router in front; everything stopped on exit. ``headers``:
    what the test's client session sends on every request (an API key)."""
    fakes: list[Fake] = []
    runner: web.AppRunner | None = None
    secret = flags[flags.index("--cluster-secret") + 1] if "--cluster-secret" in flags else None
    session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(ssl=client_ssl)
                                    if client_ssl is not None else None)
    try:
        ps = [await Fake(h, secret=secret).start() for h in prefills]
        ds = [await Fake(h, secret=secret).start() for h in decodes]
        fakes = ps + ds
        argv = ["--health-check-interval-s", "0.1", "--load-poll-interval-s", "0.1", *flags]
        for i, p in enumerate(ps):
            argv += ["--prefill", p.url, str(9000 + i)]
        for d in ds:
            argv += ["--decode", d.url]
        runner = web.AppRunner(create_app(parse_config(argv)), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)  # type: ignore[arg-type]
        await site.start()
        url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        c = Cluster(ps, ds, runner, url, session)
        if healthy:
            for f in fakes:
                await c.wait_healthy(f.url)
        yield c
    finally:
        await session.close()
        if runner is not None:
            await runner.cleanup()
        for f in fakes:
            await f.stop()


GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 3}}


def test_both_legs_get_the_body_with_bootstrap_fields_and_fresh_rooms() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode]) as c:
            results = await asyncio.gather(*(c.post("/generate", {**GEN, "rid": f"r{i}"}) for i in range(8)))
            assert all(s == 200 for s, _ in results)
            p, d = c.prefills[0], c.decodes[0]
            assert len(p.received) == len(d.received) == 8
            rooms = {b["bootstrap_room"] for b in p.received}
            assert len(rooms) == 8 and all(0 <= r < 2**63 for r in rooms)  # one fresh room per request
            by_rid = {b["rid"]: b for b in d.received}
            for pb in p.received:
                db = by_rid[pb["rid"]]
                assert pb["bootstrap_room"] == db["bootstrap_room"]
                assert pb["bootstrap_host"] == db["bootstrap_host"] == "127.0.0.1"
                assert pb["bootstrap_port"] == db["bootstrap_port"] == 9000
                assert pb["stream"] is False and pb["text"] == db["text"] == "hello"
            # /generate JSON: the prompt logprobs come from the prefill's answer
            status, out = await c.post("/generate", {**GEN, "return_logprob": True})
            assert status == 200 and out["meta_info"]["input_token_logprobs"] == [[-1.5, 7, None]]  # type: ignore[index]
            # a batch: one room per item, consecutive, distinct from every other request's
            status, _ = await c.post("/generate", {"input_ids": [[1], [2], [3]]})
            last = p.received[-1]
            assert status == 200 and len(last["bootstrap_room"]) == 3
            assert last["bootstrap_room"] == [last["bootstrap_room"][0] + i for i in range(3)]

    asyncio.run(body())


def test_stream_frames_reach_the_client_before_the_decode_sends_the_next() -> None:
    go_on = asyncio.Event()

    async def decode(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"output_ids": [1]}))
        await asyncio.wait_for(go_on.wait(), 10)  # only once the client has seen the first frame
        await resp.write(sse({"output_ids": [1, 2]}) + b"data: [DONE]\n\n")
        return resp

    async def body() -> None:
        async with router_over([ok_prefill], [decode]) as c:
            async with c.session.post(c.url + "/generate", json={**GEN, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
                assert json.loads(first[6:]) == {"output_ids": [1]}
                go_on.set()
                rest = await r.read()
            assert rest == sse({"output_ids": [1, 2]}) + b"data: [DONE]\n\n"

    asyncio.run(body())


async def reset(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
    """A node killed mid-request: the connection drops, and it answers no probe any more."""
    fake.health = 500
    assert request.transport is not None
    request.transport.close()
    raise ConnectionResetError


def test_a_dropped_prefill_is_retried_on_another_pair_with_a_new_room() -> None:
    async def body() -> None:
        async with router_over([reset, ok_prefill], [ok_decode], "--prefill-policy", "round-robin") as c:
            for _ in range(4):
                status, out = await c.post("/generate", GEN)
                assert status == 200 and out["output_ids"] == [1, 2, 3]  # type: ignore[index]
            bad, good = c.prefills
            assert bad.received, "round-robin never sent the dropping prefill anything"
            assert not (await c.workers())[bad.url]["healthy"]  # out of rotation at once
            tried = {b["bootstrap_room"] for b in bad.received}
            assert not tried & {b["bootstrap_room"] for b in good.received}  # a retry takes a new room
            async with c.session.get(c.url + "/metrics") as r:
                text = await r.text()
            assert 'pdc_router_retries_total{endpoint="generate"}' in text

    asyncio.run(body())


def test_a_5xx_is_retried_and_a_4xx_passed_through_unchanged() -> None:
    calls = {"n": 0}

    async def flaky_decode(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        calls["n"] += 1
        if body.get("text") == "bad":
            return web.json_response({"error": {"message": "temperature must be >= 0", "code": 400}}, status=400)
        if calls["n"] == 1:
            return web.json_response({"error": {"message": "KV transfer failed"}}, status=503)
        return await ok_decode(fake, request, body)

    async def body() -> None:
        async with router_over([ok_prefill], [flaky_decode]) as c:
            status, _ = await c.post("/generate", GEN)
            assert status == 200 and calls["n"] == 2
            status, out = await c.post("/generate", {**GEN, "text": "bad"})
            assert status == 400 and out == {"error": {"message": "temperature must be >= 0", "code": 400}}
            assert calls["n"] == 3  # no retry of a 4xx
            assert (await c.workers())[c.decodes[0].url]["healthy"]  # a 5xx says nothing about liveness

    asyncio.run(body())


def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def dying(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"output_ids": [1]}))
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def body() -> None:
        async with router_over([ok_prefill], [dying]) as c:
            async with c.session.post(c.url + "/generate", json={**GEN, "stream": True}) as r:
                raw = await asyncio.wait_for(r.read(), 10)
            frames = raw.split(b"\n\n")
            assert frames[0] == sse({"output_ids": [1]})[:-2]
            err = json.loads(frames[1][6:])
            assert err["error"]["code"] == 502 and "mid-stream" in err["error"]["message"]
            assert frames[2:] == [b"data: [DONE]", b""]

    asyncio.run(body())


def test_a_client_disconnect_closes_the_decode_leg() -> None:
    async def slow(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(200):
            await resp.write(sse({"output_ids": list(range(i + 1))}))
            await asyncio.sleep(0.05)
        return resp

    async def body() -> None:
        async with router_over([ok_prefill], [slow]) as c:
            async with c.session.post(c.url + "/generate", json={**GEN, "stream": True}) as r:
                await r.content.readuntil(b"\n\n")
            # leaving the block closed our connection; the router must close its leg to the decode
            await asyncio.wait_for(c.decodes[0].closed.wait(), 5)
            await asyncio.sleep(0.2)
            assert (await c.workers())[c.decodes[0].url]["inflight"] == 0

    asyncio.run(body())


def test_the_request_timeout_gives_a_504_and_frees_the_pair() -> None:
    async def stuck(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def body() -> None:
        async with router_over([ok_prefill], [stuck], "--request-timeout-s", "0.5") as c:
            status, out = await asyncio.wait_for(c.post("/generate", GEN), 5)
            assert status == 504 and "request timeout" in out["error"]["message"]  # type: ignore[index]
            await asyncio.wait_for(c.decodes[0].closed.wait(), 5)
            assert all(w["inflight"] == 0 for w in (await c.workers()).values())

    asyncio.run(body())


def test_no_healthy_prefill_means_503_and_workers_return_when_healthy() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode]) as c:
            p = c.prefills[0]
            p.health = 503
            await c.wait_healthy(p.url, healthy=False)
            status, out = await c.post("/generate", GEN)
            assert status == 503 and "no healthy prefill" in out["error"]["message"]  # type: ignore[index]
            async with c.session.get(c.url + "/health") as r:
                assert r.status == 503 and (await r.json())["healthy_prefill"] == 0
            p.health = 200
            await c.wait_healthy(p.url)
            assert (await c.post("/generate", GEN))[0] == 200

    asyncio.run(body())


def test_workers_added_and_removed_while_requests_are_in_flight() -> None:
    release = asyncio.Event()

    async def held(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.wait_for(release.wait(), 10)
        return await ok_decode(fake, request, body)

    async def body() -> None:
        async with router_over([ok_prefill], [held]) as c:
            d0 = c.decodes[0]
            inflight = asyncio.create_task(c.post("/generate", GEN))
            async with asyncio.timeout(5):
                while not d0.received:
                    await asyncio.sleep(0.02)
            extra = await Fake(ok_decode).start()
            try:
                status, _ = await c.post("/workers", {"url": extra.url, "role": "decode"})
                assert status == 200
                assert (await c.post("/workers", {"url": extra.url, "role": "decode"}))[0] == 409
                assert (await c.post("/workers", {"url": "nope", "role": "decode"}))[0] == 400
                assert (await c.post("/workers", {"url": extra.url, "role": "router"}))[0] == 400
                await c.wait_healthy(extra.url)
                async with c.session.delete(c.url + "/workers", params={"url": d0.url}) as r:
                    assert r.status == 200 and (await r.json())["draining_requests"] == 1
                assert (await c.workers())[d0.url]["draining"] is True
                for _ in range(3):  # new requests avoid the draining worker
                    assert (await c.post("/generate", GEN))[0] == 200
                assert len(extra.received) == 3 and len(d0.received) == 1
                release.set()
                assert (await inflight)[0] == 200  # the in-flight request finished on the removed node
                assert d0.url not in await c.workers()  # then it was forgotten
            finally:
                await extra.stop()

    asyncio.run(body())


def test_flush_cache_fans_out_and_metrics_count_requests() -> None:
    async def body() -> None:
        async with router_over([ok_prefill, ok_prefill], [ok_decode]) as c:
            status, out = await c.post("/flush_cache", {})
            assert status == 200 and out["success"] is True and len(out["workers"]) == 3  # type: ignore[index]
            assert all(f.other == ["/flush_cache"] for f in c.prefills + c.decodes)
            assert (await c.post("/generate", GEN))[0] == 200
            assert (await c.post("/generate", {"bogus": 1}))[0] == 400
            async with c.session.get(c.url + "/metrics") as r:
                text = await r.text()
            assert 'pdc_router_requests_total{endpoint="generate",status="200"} 1.0' in text
            assert 'pdc_router_requests_total{endpoint="generate",status="400"} 1.0' in text
            assert 'pdc_router_worker_healthy{role="decode",worker="' in text
            assert 'pdc_router_request_seconds_count{endpoint="generate"}' in text
            async with c.session.get(c.url + "/v1/models") as r:
                assert (await r.json()) == {"data": [{"id": "m"}]}

    asyncio.run(body())


@pytest.mark.parametrize("policy", ["least-loaded", "cache-aware"])
def test_a_burst_is_spread_because_each_pick_counts_the_ones_before_it(policy: str) -> None:
    """Eight requests at once: the router picks all of them before any prefill leg has started,
    so a prefill must count as busy from its pick on, not from when its leg first runs (else
    every pick sees idle workers and the whole burst lands on one)."""
    release = asyncio.Event()

    async def held_prefill(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.wait_for(release.wait(), 20)
        return await ok_prefill(fake, request, body)

    async def body() -> None:
        async with router_over([held_prefill, held_prefill], [ok_decode], "--prefill-policy", policy) as c:
            burst = [asyncio.create_task(c.post("/generate", {**GEN, "text": f"burst {i} " * 8})) for i in range(8)]
            async with asyncio.timeout(10):
                while sum(len(p.received) for p in c.prefills) < 8:
                    await asyncio.sleep(0.02)
            counts = sorted(len(p.received) for p in c.prefills)
            release.set()
            assert all(s == 200 for s, _ in await asyncio.gather(*burst))
            assert counts == [4, 4], f"the burst went {counts} over two idle prefills"

    asyncio.run(body())


def test_a_streams_prefill_tokens_stop_counting_as_queued_once_its_decode_answers(tiny_qwen3: str) -> None:
    """With token ids, a prefill carries the uncached tokens of our requests as queued (the exact
    pick weighs them). A stream's decode answers 200 with the first token, so the prompt is
    computed then, while the prefill answers only after it has noticed the transfer's end: the
    tokens must stop counting at the decode's 200, with the prefill leg still open, and its busy
    count must last until the prefill answers."""
    release, go_decode = asyncio.Event(), asyncio.Event()

    async def held_prefill(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.wait_for(release.wait(), 20)
        return await ok_prefill(fake, request, body)

    async def held_decode(fake: Fake, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.wait_for(go_decode.wait(), 20)
        return await ok_decode(fake, request, body)

    async def body() -> None:
        async with router_over([held_prefill], [held_decode], "--prefill-policy", "cache-aware",
                               "--tokenizer-path", tiny_qwen3) as c:
            [p] = c.prefills
            worker = c.runner.app[STATE].workers.get(p.url)
            assert worker is not None
            req = asyncio.create_task(c.post("/generate", {**GEN, "text": "the cache node page " * 8, "stream": True}))
            async with asyncio.timeout(10):
                while not (p.received and c.decodes[0].received):
                    await asyncio.sleep(0.02)
            assert worker.queued_tokens > 0 and worker.inflight == 1
            go_decode.set()
            async with asyncio.timeout(10):
                while worker.queued_tokens:
                    await asyncio.sleep(0.02)
            assert not release.is_set() and worker.inflight == 1  # the prefill leg is still open
            release.set()
            status, _ = await req
            assert status == 200
            async with asyncio.timeout(10):  # the handler ends just after the client has its answer
                while worker.inflight:
                    await asyncio.sleep(0.02)
            assert worker.queued_tokens == 0

    asyncio.run(body())
