"""The router's access control over scripted workers (tests/integration/test_router_http.py's
fakes, which record the Authorization header of everything they receive): ``--api-key`` guards
every endpoint but the probes, ``--cluster-secret`` goes to the nodes on every request, and the
client's key never does."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router.auth import OPERATOR_ROUTES
from tests.integration.test_router_http import GEN, Fake, ok_decode, ok_prefill, router_over

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEY = "client-api-key-0123456789abcdef"
SECRET = "cluster-secret-0123456789abcdef"
GOOD = {"Authorization": f"Bearer {KEY}"}
OPERATOR = "operator-key-0123456789abcdef"
OP = {"Authorization": f"Bearer {OPERATOR}"}
GUARDED = [("POST", "/generate", GEN), ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
           ("GET", "/v1/models", None), ("GET", "/workers", None), ("POST", "/workers", {}),
           ("DELETE", "/workers?url=http://x:1", None), ("POST", "/flush_cache", {}),
           ("POST", "/abort_request", {"abort_all": True}), ("GET", "/server_info", None), ("GET", "/metrics", None)]


async def _call(session: aiohttp.ClientSession, url: str, method: str, path: str, body: object,
                headers: dict[str, str]) -> tuple[int, object, dict]:
    async with session.request(method, url + path, json=body, headers=headers) as r:
        raw = await r.read()
        parsed = await r.json(content_type=None) if raw.startswith(b"{") else raw
        return r.status, parsed, dict(r.headers)


def test_api_key_guards_every_endpoint_but_the_probes() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--api-key", KEY, headers=GOOD) as c:
            bad_headers = [{}, {"Authorization": "Bearer wrong-key-0123456789abcdef"}, {"Authorization": KEY},
                           {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}]
            async with aiohttp.ClientSession() as anonymous:
                for method, path, payload in GUARDED:
                    for headers in bad_headers:
                        status, out, resp_headers = await _call(anonymous, c.url, method, path, payload, headers)
                        assert status == 401, f"{method} {path} with {headers}: {status} {out}"
                        which = "operator key" if (method, path.partition("?")[0]) in OPERATOR_ROUTES else "API key"
                        want = "Bearer <operator key>'" if which == "operator key" else "Bearer <key>'"
                        assert out == {"error": {"message": f"missing or invalid {which}: send 'Authorization: " + want,
                                                 "type": "AuthenticationError", "code": 401}}
                        assert resp_headers["WWW-Authenticate"].startswith("Bearer")
                for path in ("/health", "/readiness", "/liveness"):
                    status, _, _ = await _call(anonymous, c.url, "GET", path, None, {})
                    assert status == 200, path
            # nothing refused reached a worker
            assert all(not f.received and not f.other for f in c.prefills + c.decodes)
            # the key opens every client endpoint (the scheme is case-insensitive, as RFC 6750 says)
            assert (await c.post("/generate", GEN))[0] == 200
            status, _, _ = await _call(c.session, c.url, "POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}]}, {"Authorization": f"bearer {KEY}"})
            assert status == 200
            # ... and no operator endpoint: without an operator key they are off for everyone
            status, out = await c.post("/flush_cache", {})
            assert status == 403 and "no operator key" in out["error"]["message"], out  # type: ignore[index]
            async with c.session.get(c.url + "/metrics") as r:
                assert r.status == 200 and "pdc_router_requests_total" in await r.text()

    asyncio.run(body())


def test_the_cluster_secret_reaches_every_node_request_and_the_api_key_none() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--api-key", KEY, "--operator-key", OPERATOR,
                               "--cluster-secret", SECRET, headers=OP) as c:
            assert (await c.post("/generate", GEN))[0] == 200
            assert (await c.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))[0] == 200
            assert (await c.post("/flush_cache", {}))[0] == 200
            await asyncio.sleep(0.3)  # a few health probes and load polls
            for f in c.prefills + c.decodes:
                paths = {p for p, _ in f.auth}
                assert {"/health", "/get_load", "/flush_cache"} <= paths
                assert {"/generate", "/v1/chat/completions"} <= paths
                # The secret itself never travels: probes carry nothing, everything else a request
                # token that the node accepts once (common/auth.py) and that names no secret.
                assert {a for p, a in f.auth if p == "/health"} == {None}, f.auth
                assert all(a is not None and a.startswith("PDC-HMAC ") and SECRET not in a and KEY not in a and OPERATOR not in a
                           for p, a in f.auth if p != "/health"), f.auth
                assert f.verdicts and all(why is None for _, why in f.verdicts), f.verdicts

    asyncio.run(body())


def test_without_secrets_nothing_is_required_or_sent() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode]) as c:
            assert (await c.post("/generate", GEN))[0] == 200
            assert {a for f in c.prefills + c.decodes for _, a in f.auth} == {None}

    asyncio.run(body())


def test_a_node_refusing_the_cluster_secret_is_a_502_naming_it_not_the_clients_401() -> None:
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--cluster-secret", SECRET) as c:
            c.decodes[0].status = 401
            status, out = await c.post("/generate", GEN)
            assert status == 502, out
            assert "--cluster-secret" in out["error"]["message"]  # type: ignore[index]
            assert len(c.decodes[0].auth) > 0 and not c.decodes[0].received  # refused, and not retried forever

    asyncio.run(body())


def test_a_worker_that_cannot_prove_the_secret_is_sent_nothing_but_the_challenge() -> None:
    """An endpoint of a stranger's, in the router's worker list (added by mistake, or an address
    taken over): it sees only ``GET /health?challenge=...`` without credentials; no prompt, no
    token, no fan-out, and it never enters rotation."""
    async def body() -> None:
        stranger = await Fake(ok_decode).start()  # no secret: cannot answer the challenge
        try:
            async with router_over([ok_prefill], [ok_decode], "--api-key", KEY, "--operator-key", OPERATOR,
                                   "--cluster-secret", SECRET, "--decode", stranger.url, headers=OP) as c:
                await asyncio.sleep(0.5)  # several probe rounds
                for _ in range(4):
                    assert (await c.post("/generate", GEN))[0] == 200
                assert (await c.post("/flush_cache", {}))[0] == 502  # the stranger was not sent it: not all ok
                async with c.session.get(c.url + "/dashboard/data") as r:
                    assert r.status == 200
                info = (await c.workers())[stranger.url]
                assert info["healthy"] is False and "prove the cluster secret" in info["last_error"]
                assert stranger.auth and {(p, a) for p, a in stranger.auth} == {("/health", None)}, stranger.auth
                assert not stranger.received and not stranger.other
                # Out of the worker set before the router stops, so no probe is cut mid-connection.
                async with c.session.delete(c.url + "/workers", params={"url": stranger.url}) as r:
                    assert r.status == 200
                async with asyncio.timeout(10):
                    while stranger.url in await c.workers():
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
        finally:
            await stranger.stop()

    asyncio.run(body())


def test_a_client_key_cannot_add_drain_flush_or_abort_and_the_operator_key_can() -> None:
    """A client key holder used to be able to add its own URL as a worker (and receive users'
    prompts), drain the real ones, flush caches and abort every stream: now 403, nothing changed."""
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--api-key", KEY, "--operator-key", OPERATOR,
                               "--worker-allow", "127.0.0.1", headers=GOOD) as c:
            before = await c.workers()
            attempts = [("POST", "/workers", {"url": "http://127.0.0.1:9", "role": "decode"}),
                        ("DELETE", f"/workers?url={c.decodes[0].url}", None), ("POST", "/flush_cache", {}),
                        ("POST", "/abort_request", {"abort_all": True})]
            async with aiohttp.ClientSession() as s:
                for method, path, payload in attempts:
                    status, out, _ = await _call(s, c.url, method, path, payload, GOOD)
                    assert status == 403 and "operator key" in out["error"]["message"], (path, status, out)
                    status, _, _ = await _call(s, c.url, method, path, payload, {})
                    assert status == 401, path
                assert await c.workers() == before and not any(f.other for f in c.prefills + c.decodes)
                # The operator key: everything, client endpoints included.
                status, out, _ = await _call(s, c.url, "POST", "/flush_cache", {}, OP)
                assert status == 200, out
                status, _, _ = await _call(s, c.url, "POST", "/generate", GEN, OP)
                assert status == 200
                # An added URL must match --worker-allow, checked before it is contacted.
                status, out, _ = await _call(s, c.url, "POST", "/workers",
                                             {"url": "http://10.9.9.9:30001", "role": "decode"}, OP)
                assert status == 403 and "--worker-allow" in out["error"]["message"], out
                status, out, _ = await _call(s, c.url, "POST", "/workers",
                                             {"url": "http://127.0.0.1:9", "role": "decode"}, OP)
                assert status == 200, out
                # Let the probe round the addition started finish (nothing listens there) before
                # the router shuts down, so no connection is cut mid-open.
                async with asyncio.timeout(10):
                    while (await c.workers())["http://127.0.0.1:9"]["last_error"] is None:
                        await asyncio.sleep(0.05)

    asyncio.run(body())


def test_worker_allow_patterns() -> None:
    from router.config import RouterConfig, WorkerSpec

    cfg = RouterConfig(workers=(WorkerSpec("http://given.example:1", "decode"),),
                       worker_allow=("127.0.0.1", "*.decode.svc:30001", "10.0.0.0/8", "[::1]:8000"))
    allowed = ["http://127.0.0.1:5", "http://d-0.decode.svc:30001", "http://10.1.2.3:80", "http://[::1]:8000",
               "http://given.example:1"]
    refused = ["http://127.0.0.2:5", "http://d-0.decode.svc:30002", "http://evil.example:30001",
               "http://11.0.0.1:80", "http://[::1]:8001", "http://x.decode.svc.evil.example:30001"]
    assert all(cfg.worker_allowed(u) for u in allowed), [u for u in allowed if not cfg.worker_allowed(u)]
    assert not any(cfg.worker_allowed(u) for u in refused), [u for u in refused if cfg.worker_allowed(u)]
    assert RouterConfig().worker_allowed("http://anything:1")  # no list: the operator key is the gate


def test_an_operator_key_alone_guards_the_operator_endpoints_and_leaves_clients_open() -> None:
    """What pdcluster up runs by default: no client key, an operator key."""
    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--operator-key", OPERATOR) as c:
            assert (await c.post("/generate", GEN))[0] == 200
            assert len(await c.workers()) == 2
            assert (await c.post("/flush_cache", {}))[0] == 401
            async with aiohttp.ClientSession() as s:
                status, out, _ = await _call(s, c.url, "POST", "/flush_cache", {}, OP)
                assert status == 200, out

    asyncio.run(body())
