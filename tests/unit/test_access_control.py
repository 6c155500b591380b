"""Access control off the network path: reading the secrets (flag, file, variable), the node API's
check (the real app, in process, over a recording stand-in scheduler) and the bootstrap registry's
(a real server on a loopback port, driven by the real client). The router's check is in
tests/integration/test_router_auth.py, the control plane's in tests/unit/test_transfer_auth.py."""
from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bootstrap_server.client import deregister, list_ranks, lookup_layout, lookup_rank, register_rank
from bootstrap_server.errors import BootstrapError
from bootstrap_server.server import BootstrapServer
from common import envs
from common.auth import (CHALLENGE_HEADER, PROOF_HEADER, RequestSigner, RequestVerifier, SecretError, bearer_matches, new_challenge,
                         proof, proof_matches, resolve_secret, signed_headers)
from common.config import ConfigError
from common.server.app import create_app
from common.server.config import ApiConfig
from common.node.launch import transfer_config
from decode_node.__main__ import build_parser as decode_parser
from router.config import ConfigError as RouterConfigError
from router.config import parse_config
from tests.unit.test_bootstrap_server import rank
from transfer.bootstrap import HttpBootstrapClient
from transfer.config import KVManagerConfig

SECRET = "cluster-secret-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {SECRET}"}


# ---- reading and comparing secrets --------------------------------------------------------------


def test_flag_then_file_then_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "secret"
    f.write_text(f"  {SECRET}-file\n")  # a mounted Secret often ends in a newline
    monkeypatch.setenv("PDC_CLUSTER_SECRET", f"{SECRET}-env")
    assert resolve_secret(SECRET, None, envs.CLUSTER_SECRET, "--cluster-secret") == SECRET
    assert resolve_secret(None, str(f), envs.CLUSTER_SECRET, "--cluster-secret") == f"{SECRET}-file"
    assert resolve_secret(None, None, envs.CLUSTER_SECRET, "--cluster-secret") == f"{SECRET}-env"
    monkeypatch.setenv("PDC_CLUSTER_SECRET", "")
    assert resolve_secret(None, None, envs.CLUSTER_SECRET, "--cluster-secret") is None  # off by default


@pytest.mark.parametrize("value,path,match", [
    ("short", None, "at least 16 characters"),
    ("with a space 0123456789", None, "without spaces"),
    ("caf\u00e9-0123456789abcdef", None, "printable ASCII"),
    (SECRET, "file", "not both"),
    (None, "/nonexistent/secret", "cannot read '/nonexistent/secret'"),
    (None, "empty", "is empty"),
])
def test_bad_secrets_are_refused_naming_the_flag(tmp_path: Path, value: str | None, path: str | None,
                                                 match: str) -> None:
    if path in ("file", "empty"):
        p = tmp_path / path
        p.write_text(SECRET if path == "file" else "\n")
        path = str(p)
    with pytest.raises(SecretError, match=match) as err:
        resolve_secret(value, path, envs.CLUSTER_SECRET, "--cluster-secret")
    assert "--cluster-secret" in str(err.value) and (value is None or value == SECRET or value not in str(err.value))


def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDC_API_KEY", "tiny")
    with pytest.raises(RouterConfigError, match="PDC_API_KEY must be at least 16"):
        parse_config([])


def test_bearer_matches_only_the_exact_token() -> None:
    assert bearer_matches(f"Bearer {SECRET}", SECRET) and bearer_matches(f"bearer  {SECRET} ", SECRET)
    for header in (None, "", SECRET, f"Basic {SECRET}", f"Bearer {SECRET[:-1]}", f"Bearer {SECRET}x", "Bearer ",
                   "Bearer caf\u00e9"):
        assert not bearer_matches(header, SECRET), header


def test_router_and_node_flags_carry_secrets_that_never_show_in_a_repr(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("PDC_CLUSTER_SECRET", SECRET)
    cfg = parse_config(["--api-key", "k" * 16])
    assert (cfg.api_key, cfg.cluster_secret) == ("k" * 16, SECRET) and SECRET not in repr(cfg)
    tc = transfer_config(decode_parser().parse_args(["--model-path", str(tmp_path)]))
    assert tc.cluster_secret == SECRET and SECRET not in repr(tc)
    assert SECRET not in repr(KVManagerConfig.from_transfer_config(tc))
    ns = decode_parser().parse_args(["--model-path", str(tmp_path), "--cluster-secret", "short"])
    with pytest.raises(ConfigError, match="--cluster-secret must be at least 16"):
        transfer_config(ns)
    assert SECRET not in repr(HttpBootstrapClient().with_secret(SECRET))


# ---- the node API ---------------------------------------------------------------------------------


class RecordingScheduler:
    """What the app asks of its SchedulerClient, recorded; it answers like an idle scheduler."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gone_reason: str | None = None
        self.ready = threading.Event()
        self.ready.set()

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def query(self, what: str, timeout_s: float) -> dict:
        self.calls.append(what)
        return {"num_reqs": 0} if what == "load" else {"free_pages": 1}

    async def flush_cache(self, timeout_s: float) -> dict:
        self.calls.append("flush_cache")
        return {"success": True}

    def is_inflight(self, rid: str) -> bool:
        self.calls.append(f"is_inflight {rid}")
        return True

    def abort(self, rid: str) -> None:
        self.calls.append(f"abort {rid}")


def _node(secret: str | None, accept_bearer: bool = False) -> tuple[TestClient, RecordingScheduler]:
    sched = RecordingScheduler()
    cfg = ApiConfig(role="prefill", model_path="/m", context_length=64, cluster_secret=secret,
                    accept_bearer_secret=accept_bearer)
    return TestClient(create_app(cfg, sched, None)), sched  # type: ignore[arg-type]  # no tokenizer: never reached


NODE_ROUTES = [("POST", "/abort_request", {"rid": "r1"}), ("POST", "/flush_cache", None),
               ("GET", "/debug/memory", None), ("GET", "/get_load", None), ("GET", "/metrics", None),
               ("POST", "/generate", {"text": "hi"}), ("POST", "/v1/chat/completions", {}),
               ("GET", "/server_info", None), ("GET", "/v1/models", None), ("GET", "/health_generate", None),
               ("GET", "/openapi.json", None)]


def _signed(method: str, path: str, body: object = None, secret: str = SECRET) -> dict:
    """``client.request`` arguments with a request token over exactly the bytes sent."""
    raw = b"" if body is None else json.dumps(body).encode()
    return {"method": method, "url": path, "content": raw,
            "headers": {"Content-Type": "application/json", **signed_headers(secret, method, path, raw)}}


def test_a_node_with_a_secret_refuses_every_route_but_health_without_it() -> None:
    client, sched = _node(SECRET)
    for method, path, body in NODE_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong-secret-0123456789ab"}, {"Authorization": SECRET},
                        AUTH):  # the bare secret as a bearer token too: it must never have to travel
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, f"{method} {path} {headers}: {r.status_code} {r.text}"
            assert r.json()["error"]["type"] == "AuthenticationError" and r.headers["www-authenticate"].startswith("Bearer")
        wrong = _signed(method, path, body, secret="wrong-secret-0123456789abcdef")
        assert client.request(**wrong).status_code == 401, f"{method} {path} with another secret's token"
    assert sched.calls == []  # nothing refused reached the scheduler: no abort, no flush
    assert client.get("/health").status_code == 200
    r = client.request(**_signed("POST", "/abort_request", {"rid": "r1"}))
    assert r.status_code == 200 and r.json() == {"aborted": ["r1"]}
    assert client.request(**_signed("POST", "/flush_cache")).json()["success"] is True
    assert client.request(**_signed("GET", "/debug/memory")).status_code == 200
    assert sched.calls == ["is_inflight r1", "abort r1", "flush_cache", "memory"]


def test_a_request_token_is_good_for_its_own_request_once() -> None:
    """What a recording endpoint could do with a token it saw: replay it as is, on another path,
    with another body or method: all refused, and the scheduler never asked."""
    client, sched = _node(SECRET)
    seen = _signed("POST", "/abort_request", {"rid": "r1"})
    assert client.request(**seen).status_code == 200
    sched.calls.clear()
    tampered = [seen,  # the same request again
                {**seen, "content": json.dumps({"abort_all": True}).encode()},  # another body
                {**seen, "url": "/flush_cache"},  # another path
                {**seen, "url": "/abort_request?x=1"},  # another query
                {**seen, "method": "PUT"}]  # another method
    for req in tampered:
        assert client.request(**req).status_code == 401, req
    assert sched.calls == []


def test_request_tokens_expire_and_malformed_ones_are_refused() -> None:
    verifier = RequestVerifier(SECRET, window_s=60)
    signer = RequestSigner(SECRET)
    old = signer.authorization("GET", "/get_load", b"", now=time.time() - 120)
    assert "expired" in (verifier.check(old, "GET", "/get_load") or "")
    future = signer.authorization("GET", "/get_load", b"", now=time.time() + 120)
    assert "expired" in (verifier.check(future, "GET", "/get_load") or "")
    for header in ("PDC-HMAC", "PDC-HMAC ts=1,nonce=x,mac=y", "PDC-HMAC ts=abc,nonce=0123456789abcdef01,mac=" + "0" * 64,
                   "Digest x", "PDC-HMAC ,,,,", "PDC-HMAC ts=1=2,nonce==,mac"):
        assert verifier.check(header, "GET", "/get_load") is not None, header
    assert verifier.check(signer.authorization("GET", "/get_load"), "GET", "/get_load") is None


def test_the_nonce_memory_is_bounded() -> None:
    verifier = RequestVerifier(SECRET, max_nonces=10)
    signer = RequestSigner(SECRET)
    for _ in range(50):
        assert verifier.check(signer.authorization("GET", "/x"), "GET", "/x") is None
    assert len(verifier._seen) <= 10


def test_the_bare_secret_is_taken_only_where_sglang_router_needs_it() -> None:
    client, sched = _node(SECRET, accept_bearer=True)
    assert client.post("/abort_request", json={"rid": "r1"}, headers=AUTH).status_code == 200
    assert client.post("/abort_request", json={"rid": "r1"},
                       headers={"Authorization": "Bearer wrong-secret-0123456789ab"}).status_code == 401
    assert client.request(**_signed("POST", "/flush_cache")).status_code == 200  # tokens still work


def test_health_proves_the_secret_to_a_challenger_and_to_no_one_else() -> None:
    client, _ = _node(SECRET)
    challenge = new_challenge()
    r = client.get(f"/health?challenge={challenge}")
    assert r.status_code == 200 and proof_matches(SECRET, challenge, r.headers.get(PROOF_HEADER))
    assert not proof_matches("wrong-secret-0123456789abcdef", challenge, r.headers.get(PROOF_HEADER))
    assert PROOF_HEADER.lower() not in {k.lower() for k in client.get("/health").headers}  # no challenge: no proof
    open_client, _ = _node(None)
    assert PROOF_HEADER.lower() not in {k.lower() for k in open_client.get(f"/health?challenge={challenge}").headers}


def test_a_node_without_a_secret_is_open_as_before() -> None:
    client, sched = _node(None)
    assert client.post("/abort_request", json={"rid": "r1"}).status_code == 200
    assert client.post("/flush_cache").status_code == 200
    assert sched.calls == ["is_inflight r1", "abort r1", "flush_cache"]


# ---- the bootstrap registry -------------------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[BootstrapServer]:
    srv = BootstrapServer("127.0.0.1", 0, secret=SECRET)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _raw(srv: BootstrapServer, method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status == 401:
            assert "cluster secret" in json.loads(payload)["error"]
        return resp.status
    finally:
        conn.close()


def test_the_registry_refuses_registration_and_lookups_without_the_secret(registry: BootstrapServer) -> None:
    info = rank()
    for secret in (None, "wrong-secret-0123456789abcdef"):
        with pytest.raises(BootstrapError) as err:
            register_rank(registry.url, info, secret=secret)
        assert err.value.status == 401
    assert registry.registry.ranks() == []  # nothing registered
    body = json.dumps({"rank_ip": "10.0.0.66"}).encode()
    for method, path in [("PUT", "/route"), ("DELETE", "/route?engine_rank=-1&target_dp_group=-1"), ("GET", "/routes"),
                         ("GET", "/route?engine_rank=-1&target_dp_group=-1")]:
        assert _raw(registry, method, path, {}, body if method == "PUT" else None) == 401, (method, path)
    assert _raw(registry, "GET", "/health", {}) == 200
    register_rank(registry.url, info, secret=SECRET)
    assert [r.rank_port for r in list_ranks(registry.url, secret=SECRET)] == [info.rank_port]
    with pytest.raises(BootstrapError) as err:  # a lookup without it fails at once, not after retries
        lookup_rank(registry.url, 0, 0, timeout_s=5.0)
    assert err.value.status == 401
    assert lookup_layout(registry.url, secret=SECRET).tp_size == info.tp_size
    assert HttpBootstrapClient(secret=SECRET).lookup_rank(registry.url, 0, 0).rank_port == info.rank_port
    assert _raw(registry, "DELETE", "/route?engine_rank=-1&target_dp_group=-1", {}) == 401
    assert len(registry.registry.ranks()) == 1  # the refused DELETE removed nothing
    assert deregister(registry.url, 0, 0, secret=SECRET) is True


def test_a_node_believes_only_a_registry_that_proves_the_secret(registry: BootstrapServer) -> None:
    """A request's bootstrap_host may name a stranger's listener: one that answers like a
    registry but cannot prove the cluster secret is refused at once (nothing reserved, no KV
    args sent). Its best try, relaying the challenge to a node's open /health, gets a worker
    proof, which is no registry proof."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    asked: list[str] = []

    class Rogue(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(self.path)
            body = json.dumps({"rank_ip": "127.0.0.1"}).encode()
            self.send_response(200)
            self.send_header(PROOF_HEADER, proof(SECRET, self.headers.get(CHALLENGE_HEADER) or "", "worker"))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None: ...

    server = HTTPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(BootstrapError, match="not this cluster's") as err:
            lookup_layout(f"http://127.0.0.1:{server.server_address[1]}", secret=SECRET)
        assert err.value.status == 401 and asked  # it was asked, and not believed
    finally:
        server.shutdown()
        server.server_close()
    # The real registry proves it on every answer: a 200, and a 404 (not registered yet) alike.
    with pytest.raises(BootstrapError) as missing:
        lookup_rank(registry.url, 0, 0, timeout_s=0.3, secret=SECRET)
    assert missing.value.status == 404, missing.value
    register_rank(registry.url, rank(), secret=SECRET)
    assert lookup_rank(registry.url, 0, 0, secret=SECRET).rank_port == rank().rank_port
