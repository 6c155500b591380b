"""Per-client keys at the router (router/clients.py) over the scripted workers of
test_router_http.py: a keys file names clients with roles, endpoints and rate limits; a client
over a limit gets 429 with Retry-After and touches no worker while another client is served
as before; the file is reloaded on SIGHUP (a broken one keeps the keys in force); every keyed
request is counted by its client's name."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

import aiohttp
import pytest

from router.__main__ import main as router_main
from router.clients import KeysFileError, parse_keys, token_estimate
from tests.integration.test_router_http import GEN, ok_decode, ok_prefill, router_over

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ALICE, BOB, CAROL, OPS = ("alice-key-0123456789abcdef", "bob-key-0123456789abcdef", "carol-key-0123456789abcdef",
                          "ops-key-0123456789abcdef")


def keys(path: Path, extra: list[dict] | None = None) -> str:
    path.write_text(json.dumps({"keys": [
        {"key": ALICE, "name": "alice", "requests_per_min": 3, "endpoints": ["/generate", "/v1/models"]},
        {"key": BOB, "name": "bob"},
        {"key": CAROL, "name": "carol", "tokens_per_min": 100},
        {"key": OPS, "name": "ops", "role": "operator"},
        *(extra or []),
    ]}))
    return str(path)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(s: aiohttp.ClientSession, url: str, key: str, path: str = "/generate", body: object = GEN,
               method: str = "POST") -> tuple[int, dict, dict]:
    async with s.request(method, url + path, json=body, headers=bearer(key)) as r:
        raw = await r.read()
        return r.status, (json.loads(raw) if raw.startswith(b"{") else {}), dict(r.headers)


def test_roles_endpoints_and_rate_limits(tmp_path: Path) -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--keys-file", keys(tmp_path / "keys.json"),
                               headers=bearer(OPS)) as c, aiohttp.ClientSession() as s:
            for _ in range(3):
                assert (await call(s, c.url, ALICE))[0] == 200
            served = len(c.decodes[0].received)
            status, out, headers = await call(s, c.url, ALICE)
            assert status == 429 and out["error"]["type"] == "RateLimitError", out
            assert 1 <= int(headers["Retry-After"]) <= 20, headers  # a third of a minute per request
            assert len(c.decodes[0].received) == served  # refused before any worker saw it
            assert (await call(s, c.url, BOB))[0] == 200  # another client is not held back
            # Endpoints and roles.
            status, out, _ = await call(s, c.url, ALICE, "/v1/chat/completions", {"messages": []})
            assert status == 403 and "may not call" in out["error"]["message"]
            assert (await call(s, c.url, BOB, "/flush_cache", {}))[0] == 403
            assert (await call(s, c.url, OPS, "/flush_cache", {}))[0] == 200
            assert (await call(s, c.url, "not-a-key-0123456789abcdef"))[0] == 401
            # Tokens per minute (carol: 100): 80 new tokens go, the next 80 do not.
            small = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 80}}
            assert (await call(s, c.url, CAROL, body=small))[0] == 200
            status, out, headers = await call(s, c.url, CAROL, body=small)
            assert status == 429 and "tokens per minute" in out["error"]["message"] and "Retry-After" in headers
            async with s.get(c.url + "/metrics", headers=bearer(OPS)) as r:
                text = await r.text()
            assert 'pdc_router_client_requests_total{client="alice",status="429"} 1.0' in text, text
            assert 'pdc_router_client_requests_total{client="bob",status="200"} 1.0' in text
            assert 'pdc_router_client_requests_total{client="-",status="401"} 1.0' in text

    asyncio.run(body())


def test_a_limited_client_does_not_slow_another(tmp_path: Path) -> None:
    """Bob's latency while alice floods the router with refused requests, against bob alone
    (a loose bound: this is a behaviour check, the figures belong in a benchmark)."""
    async def bob_p50(s: aiohttp.ClientSession, url: str, n: int = 30) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            assert (await call(s, url, BOB))[0] == 200
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--keys-file", keys(tmp_path / "keys.json"),
                               headers=bearer(OPS)) as c, aiohttp.ClientSession() as s:
            alone = await bob_p50(s, c.url)
            stop = asyncio.Event()
            refused = 0

            async def flood() -> None:
                nonlocal refused
                while not stop.is_set():
                    refused += (await call(s, c.url, ALICE))[0] == 429

            floods = [asyncio.create_task(flood()) for _ in range(4)]
            loaded = await bob_p50(s, c.url)
            stop.set()
            await asyncio.gather(*floods)
            assert refused > 30
            assert loaded <= 1.5 * alone + 0.010, (alone, loaded)

    asyncio.run(body())


def test_sighup_reloads_the_keys_file_and_a_broken_one_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    dave = "dave-key-0123456789abcdef"

    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--keys-file", keys(path), headers=bearer(OPS)) as c, \
                aiohttp.ClientSession() as s:
            assert (await call(s, c.url, dave))[0] == 401
            keys(path, [{"key": dave, "name": "dave"}])
            os.kill(os.getpid(), signal.SIGHUP)  # the router's loop handles it
            async with asyncio.timeout(5):
                while (await call(s, c.url, dave))[0] != 200:
                    await asyncio.sleep(0.05)
            path.write_text("{not json")
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.2)
            assert (await call(s, c.url, dave))[0] == 200 and (await call(s, c.url, BOB))[0] == 200

    asyncio.run(body())


@pytest.mark.parametrize("doc, match", [
    ("nope", "not JSON"), ('{"k": []}', "expected"),
    ('{"keys": [{"key": "short", "name": "a"}]}', "at least 16"),
    ('{"keys": [{"key": "k-0123456789abcdef", "name": "a", "role": "admin"}]}', "role"),
    ('{"keys": [{"key": "k-0123456789abcdef", "name": "a b"}]}', "name"),
    ('{"keys": [{"key": "k-0123456789abcdef", "name": "a", "requests_per_min": 0}]}', "> 0"),
    ('{"keys": [{"key": "k-0123456789abcdef", "name": "a", "colour": 1}]}', "unknown fields"),
    ('{"keys": [{"key": "k-0123456789abcdef", "name": "a"}, {"key": "k-0123456789abcdef", "name": "b"}]}', "twice"),
])
def test_bad_keys_files_are_refused_naming_the_entry(doc: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match=match):
        parse_keys(doc, "keys.json")
    bad = tmp_path / "bad.json"
    bad.write_text(doc)
    assert router_main(["--keys-file", str(bad), "--decode", "http://127.0.0.1:9"]) == 2


def test_token_estimate() -> None:
    assert token_estimate({"max_tokens": 10}, 400, 2) == 100 + 20
    assert token_estimate({"sampling_params": {"max_new_tokens": 5}}, 40, 1) == 15
    assert token_estimate({}, 0, 1) == 128  # what a node gives a /generate body without it


def test_a_request_larger_than_a_minutes_worth_goes_once_the_bucket_is_full_and_leaves_debt() -> None:
    from router.clients import Clients, ClientSpec

    clients = Clients()
    big = ClientSpec("big", tokens_per_min=60.0)  # one token a second
    assert clients.take(big, "tokens", 150.0, now=0.0) == 0.0  # a full bucket lets it through ...
    wait = clients.take(big, "tokens", 10.0, now=1.0)  # ... into debt: 60 - 150 + 1 = -89
    assert wait == pytest.approx(99.0)  # 10 more tokens need the debt paid first
    assert clients.take(big, "tokens", 10.0, now=100.0) == 0.0
    assert clients.take(big, "tokens", 150.0, now=101.0) == pytest.approx(59.0)  # level 1: waits for a full bucket


def test_settling_refunds_and_charges_within_the_buckets_rules() -> None:
    """A fake clock (``now``): the estimate taken at admission is settled against the usage."""
    from router.clients import Clients, ClientSpec

    clients = Clients()
    c = ClientSpec("c", tokens_per_min=60.0)  # one token a second
    assert clients.take(c, "tokens", 50.0, now=0.0) == 0.0  # level 10
    clients.settle(c, "tokens", charged=50.0, used=20.0, now=0.0)  # 30 back: level 40
    assert clients.take(c, "tokens", 40.0, now=0.0) == 0.0
    assert clients.take(c, "tokens", 1.0, now=0.0) == pytest.approx(1.0)  # empty: a second for one token
    clients.settle(c, "tokens", charged=40.0, used=0.0, now=10.0)  # refilled to 10, +40 back: full at 50
    assert clients.take(c, "tokens", 50.0, now=10.0) == 0.0
    clients.settle(c, "tokens", charged=10.0, used=1000.0, now=10.0)  # a charge stops at a minute of debt
    assert clients.take(c, "tokens", 1.0, now=10.0) == pytest.approx(61.0)  # level -60, not -990
    clients.settle(c, "tokens", charged=0.0, used=0.0, now=200.0)  # nothing to settle
    clients.settle(c, "tokens", charged=1000.0, used=0.0, now=200.0)  # a refund never overfills
    assert clients.take(c, "tokens", 60.0, now=200.0) == 0.0
    assert clients.take(c, "tokens", 1.0, now=200.0) > 0
    unlimited = ClientSpec("u")
    clients.settle(unlimited, "tokens", charged=10.0, used=0.0, now=0.0)  # no bucket: nothing happens


def test_reported_usage_and_stream_usage() -> None:
    from router.forward import reported_usage, stream_usage

    assert reported_usage({"usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}) == 10
    assert reported_usage({"meta_info": {"prompt_tokens": 4, "completion_tokens": 2}}) == 6
    assert reported_usage([{"meta_info": {"prompt_tokens": 4, "completion_tokens": 2}}] * 2) == 12
    assert reported_usage([{"meta_info": {"prompt_tokens": 4}}]) is None
    assert reported_usage({"meta_info": {"prompt_tokens": True, "completion_tokens": 2}}) is None
    assert reported_usage([]) is None and reported_usage("x") is None
    frame = b'data: {"meta_info": {"prompt_tokens": 4, "completion_tokens": 5}}\n\ndata: [DONE]\n\n'
    assert stream_usage(frame, 1) == 9
    assert stream_usage(frame, 2) is None  # one sequence's count, not the request's
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 10}}\n\ndata: [DONE]\n\n'
    assert stream_usage(usage, 2) == 14
    assert stream_usage(b'data: {"choices": []}\n\ndata: [DONE]\n\n', 1) is None
    assert stream_usage(b"data: [DONE]\n\n", 1) is None


async def usage_decode(fake, request, body):  # type: ignore[no-untyped-def]
    """Reports 2 prompt + 3 completion tokens, or 500 prompt tokens for input_ids [9, 9]; 400 for [4, 4]."""
    from aiohttp import web

    if body.get("input_ids") == [4, 4]:
        return web.json_response({"error": {"message": "bad input", "code": 400}}, status=400)
    meta = {"id": "d", "prompt_tokens": 500 if body.get("input_ids") == [9, 9] else 2, "completion_tokens": 3}
    if not body.get("stream"):
        return web.json_response({"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: " + json.dumps({"output_ids": [1, 2, 3], "meta_info": meta}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def test_token_buckets_are_settled_with_the_usage_the_nodes_report(tmp_path: Path) -> None:
    """carol (100 tokens/min) asks for up to 40 new tokens each time (~60 estimated): without
    settling, the second request is a 429; settled against 5 used tokens, five go in a row,
    streamed or not, and so do failed ones (refunded in full). A request that reports more than
    estimated leaves her in debt: the next one is a 429."""
    async def body() -> None:
        async with router_over([ok_prefill], [usage_decode], "--keys-file", keys(tmp_path / "keys.json"),
                               headers=bearer(OPS)) as c, aiohttp.ClientSession() as s:
            small = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 40}}
            for i in range(5):
                status, out, _ = await call(s, c.url, CAROL, body={**small, "stream": i % 2 == 1})
                assert status == 200, (i, out)
            for _ in range(2):
                status, _, _ = await call(s, c.url, CAROL, body={**small, "input_ids": [4, 4]})
                assert status == 400
            assert (await call(s, c.url, CAROL, body=small))[0] == 200
            assert (await call(s, c.url, CAROL, body={**small, "input_ids": [9, 9]}))[0] == 200  # 503 used
            status, out, headers = await call(s, c.url, CAROL, body=small)
            assert status == 429 and int(headers["Retry-After"]) > 60, (out, headers)  # a minute of debt first

    asyncio.run(body())
