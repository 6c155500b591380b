"""The router's KV-event subscription (router/kv_subscriber.py) against a scripted prefill that
publishes sealed batches on a real ZMQ PUB socket and serves /server_info and the snapshot: the
real router app in front, a secured cluster. Hostile and broken input is dropped and counted, a
gap resyncs from the snapshot, a silent publisher degrades its worker to load-based routing, and
no client request fails on any of it."""
from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web

from common.auth import PROOF_HEADER, proof
from common.kv_events import BlockStored, EventCodec, KVEventBatch, KVSnapshot, block_hashes
from router.app import create_app
from router.config import parse_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SECRET = "kv-subscriber-test-secret-0123"
BS = 4
PROMPT = list(range(50, 61))  # 11 tokens: blocks 0 and 1 can hit (the last token's block never)


class FakePrefill:
    """Health with the secret's proof, /server_info announcing the PUB socket, the snapshot, and a
    /generate whose meta_info reports ``cached`` tokens; heartbeats every 0.1 s unless ``quiet``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.codec = EventCodec(SECRET)
        self.blocks: list[int] = block_hashes(PROMPT[:8], BS)
        self.seq = 3
        self.cached = 8
        self.quiet = False
        self.snapshots = 0
        self.url = ""

    def batch(self, seq: int, events: list) -> KVEventBatch:
        return KVEventBatch(instance_id="node-1", seq=seq, block_size=BS, role="prefill", ts=0.0, events=events)

    def send(self, frame: bytes) -> None:
        self.pub.send(frame)

    async def heartbeats(self) -> None:
        while True:
            if not self.quiet:
                self.send(self.codec.encode(self.batch(self.seq, [])))
            await asyncio.sleep(0.1)

    async def start(self) -> web.AppRunner:
        async def health(request: web.Request) -> web.Response:
            challenge = request.query.get("challenge")
            return web.json_response({}, headers={PROOF_HEADER: proof(SECRET, challenge)} if challenge else None)

        async def server_info(_: web.Request) -> web.Response:
            return web.json_response({"kv_events": {"endpoint": f"tcp://127.0.0.1:{self.port}", "block_size": BS}})

        async def snapshot(_: web.Request) -> web.Response:
            self.snapshots += 1
            snap = KVSnapshot(instance_id="node-1", seq=self.seq, block_size=BS, role="prefill", blocks=self.blocks)
            return web.Response(body=msgspec.json.encode(snap), content_type="application/json")

        async def generate(_: web.Request) -> web.Response:
            return web.json_response({"text": "", "meta_info": {"cached_tokens": self.cached}})

        async def load(_: web.Request) -> web.Response:
            return web.json_response([{"num_reqs": 0}])

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", server_info)
        app.router.add_get("/kv_events/snapshot", snapshot)
        app.router.add_get("/get_load", load)
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return runner


async def decode_app() -> tuple[web.AppRunner, str]:
    async def health(request: web.Request) -> web.Response:
        challenge = request.query.get("challenge")
        return web.json_response({}, headers={PROOF_HEADER: proof(SECRET, challenge)} if challenge else None)

    async def generate(_: web.Request) -> web.Response:
        return web.json_response({"text": "x", "output_ids": [1], "meta_info": {}})

    async def load(_: web.Request) -> web.Response:
        return web.json_response([{"num_reqs": 0}])

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_load", load)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@contextlib.asynccontextmanager
async def routed(tokenizer: str) -> AsyncIterator[tuple[FakePrefill, str, aiohttp.ClientSession]]:
    p = FakePrefill()
    try:
        p_runner = await p.start()
    except BaseException:
        p.ctx.destroy(linger=0)
        raise
    d_runner, d_url = await decode_app()
    beats = asyncio.create_task(p.heartbeats())
    # The prefill's subscription alone (the decode stand-in publishes nothing; a cache-aware decode
    # policy would subscribe to it too).
    cfg = parse_config(["--prefill-policy", "cache-aware", "--tokenizer-path", tokenizer, "--cluster-secret", SECRET,
                        "--kv-events-stale-s", "0.6", "--health-check-interval-s", "0.1",
                        "--prefill", p.url, "9000", "--decode", d_url])
    runner = web.AppRunner(create_app(cfg))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    session = aiohttp.ClientSession()
    try:
        yield p, url, session
    finally:
        await session.close()
        await runner.cleanup()
        beats.cancel()
        for r in (p_runner, d_runner):
            await r.cleanup()
        p.ctx.destroy(linger=0)


@pytest.fixture
def tokenizer_json(tmp_path) -> str:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


async def counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for m in re.finditer(r'^pdc_router_kv_(events_total|picks_total|predictions_total|index_synced)\{([^}]*)\} ([0-9.e+-]+)$',
                         text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        out[f"{m.group(1)}:{labels.get('verdict') or labels.get('mode') or labels.get('outcome') or 'synced'}"] = \
            float(m.group(3))
    return out


async def wait_for(session: aiohttp.ClientSession, url: str, key: str, at_least: float, timeout_s: float = 10) -> dict:
    async with asyncio.timeout(timeout_s):
        while True:
            c = await counts(session, url)
            if c.get(key, 0) >= at_least:
                return c
            await asyncio.sleep(0.05)


async def generate(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}) as r:
        await r.read()
        return r.status


def test_hostile_frames_are_dropped_gaps_resync_and_silence_degrades_to_load(tokenizer_json: str) -> None:
    async def body() -> None:
        async with routed(tokenizer_json) as (p, url, session):
            await wait_for(session, url, "index_synced:synced", 1)
            assert await generate(session, url) == 200
            c = await wait_for(session, url, "predictions_total:exact", 1)  # predicted 8, the prefill said 8
            assert c.get("picks_total:exact") == 1

            stored = p.codec.encode(p.batch(4, [BlockStored(parent_hash=p.blocks[-1], block_hashes=[123])]))
            p.send(b"\x00garbage")  # not sealed
            p.send(EventCodec("some-other-secret-0123456").encode(p.batch(4, [])))  # a stranger's seal
            p.send(stored)
            p.send(stored)  # the same frame again: its nonce was seen
            p.seq = 4
            p.send(p.codec.encode(p.batch(2, [BlockStored(parent_hash=None, block_hashes=[7])])))  # old seq, fresh seal
            c = await wait_for(session, url, "events_total:replayed", 1)
            assert c["events_total:unauthenticated"] == 3 and c["events_total:applied"] >= 1

            snapshots = p.snapshots
            p.seq = 9  # batches 5..8 never sent: the next heartbeat shows the gap
            c = await wait_for(session, url, "events_total:gap", 1)
            async with asyncio.timeout(5):
                while p.snapshots == snapshots or (await counts(session, url)).get("index_synced:synced") != 1:
                    await asyncio.sleep(0.05)

            p.quiet = True  # the publisher goes silent: the index is dropped, routing goes by load
            await wait_for(session, url, "events_total:silent", 1)
            assert (await counts(session, url)).get("index_synced:synced", 0) == 0
            assert await generate(session, url) == 200  # never a 5xx for a lost subscription
            c = await counts(session, url)
            assert c.get("picks_total:unsynced") == 1 and c.get("predictions_total:exact") == 1

            p.quiet = False  # it comes back: resubscribed, resynced, predicting again
            await wait_for(session, url, "index_synced:synced", 1)
            assert await generate(session, url) == 200
            await wait_for(session, url, "predictions_total:exact", 2)

    asyncio.run(body())
