"""Property-based fuzzing of every HTTP API of a real cluster: our router, a prefill node, a decode
node (1 + 1, Mooncake over TCP, tiny qwen3: the session's ``scripted_routed``) and the prefill's
bootstrap registry.

hypothesis draws bodies of three kinds for every route: arbitrary JSON values, request-shaped
objects whose fields take wrong types and edge values (negative, huge, NaN-like strings, unicode,
nested junk), and raw bytes (truncated JSON, wrong content types). The oracle for each answer:

- no 5xx, except the documented 503 (a node whose KV transfer failed: a body aimed straight at
  a node with bootstrap fields pointing nowhere) and the router's 502 after every try failed
  (both carry a message);
- the server still answers ``/health`` afterwards;
- at the end every node is back at idle memory and the registry holds exactly the rank it held
  before (every fuzzed ``PUT /route`` was refused or, when valid, removed again).

``FUZZ_EXAMPLES`` scales the example counts (the default keeps the whole file near a minute).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
TIMEOUT_S = 30.0
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Edge values any field may take.
EDGE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 8), st.sampled_from([-2**63, 2**63, 2**70, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(["NaN", "Infinity", "-1", "1e999", ""]),
    st.text(max_size=12), st.lists(st.integers(-5, 2000), max_size=6), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=16),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "n", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "skip_special_tokens"]
NATIVE_KEYS = ["text", "input_ids", "stream", "rid", "return_logprob", "top_logprobs_num", "bootstrap_host",
               "bootstrap_port", "bootstrap_room", "return_text_in_logprobs", "logprob_start_len"]
OPENAI_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
               "n", "temperature", "top_p", "stop", "logprobs", "top_logprobs", "seed", "ignore_eos", "return_timeline",
               "bootstrap_room", "echo", "user"]


def shaped(keys: list[str], sampling: bool) -> st.SearchStrategy[dict]:
    body = st.dictionaries(st.sampled_from(keys), EDGE, max_size=5)
    if not sampling:
        return body
    params = st.dictionaries(st.sampled_from(SAMPLING_KEYS), EDGE, max_size=4)
    # Keep generation short when a body happens to be valid: max_new_tokens from small values.
    params = params.map(lambda p: {**p, "max_new_tokens": p.get("max_new_tokens", 2)}
                        if isinstance(p.get("max_new_tokens", 2), bool) or not isinstance(p.get("max_new_tokens", 2), int)
                        or p.get("max_new_tokens", 2) <= 8 or p.get("max_new_tokens", 2) > 2**62
                        else {**p, "max_new_tokens": 4})
    return st.builds(lambda b, p: {**b, "sampling_params": p}, body, params)


def bodies(keys: list[str], sampling: bool = False) -> st.SearchStrategy[tuple[str, bytes]]:
    """(content type, raw body): JSON values, request-shaped objects, or broken bytes."""
    as_json = st.one_of(JSON, shaped(keys, sampling)).map(lambda v: ("application/json", json.dumps(v).encode()))
    broken = st.one_of(
        shaped(keys, sampling).map(lambda v: json.dumps(v).encode()).flatmap(
            lambda raw: st.integers(0, max(len(raw) - 1, 0)).map(lambda k: raw[:k])),  # truncated
        st.binary(max_size=64),
    ).flatmap(lambda raw: st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"])
              .map(lambda ct: (ct, raw)))
    return st.one_of(as_json, as_json, broken)


def check(r: httpx.Response, what: str, allowed_5xx: tuple[int, ...] = ()) -> None:
    assert r.status_code < 500 or r.status_code in allowed_5xx, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert r.text.strip(), f"{what}: {r.status_code} without a message"


@pytest.fixture(scope="module")
def cluster(scripted_routed: tuple[LocalCluster, str]) -> Iterator[tuple[LocalCluster, str]]:
    """The session's ``scripted_routed`` cluster (tests/e2e/conftest.py: what the model says is
    never read here); the registry and every node must end as they began."""
    c, url = scripted_routed
    routes_before = httpx.get(f"http://127.0.0.1:{c.prefills[0].bootstrap_port}/routes", timeout=10).json()
    yield c, url
    for n in c.nodes:
        wait_idle(n.url, timeout_s=30)
    routes_after = httpx.get(f"http://127.0.0.1:{c.prefills[0].bootstrap_port}/routes", timeout=10).json()
    assert routes_after == routes_before, "a fuzzed PUT /route changed the registry"
    assert httpx.get(url + "/health", timeout=10).status_code == 200


GENERATION = [("/generate", NATIVE_KEYS, True), ("/v1/completions", OPENAI_KEYS, False),
              ("/v1/chat/completions", OPENAI_KEYS, False)]


@pytest.mark.parametrize("path,keys,sampling", GENERATION)
def test_generation_routes_of_router_and_nodes(cluster: tuple[LocalCluster, str], path: str, keys: list[str],
                                               sampling: bool) -> None:
    c, url = cluster
    targets = {"router": (url, (502, 503, 504)), "prefill": (c.prefills[0].url, (503,)),
               "decode": (c.decodes[0].url, (503,))}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        @SETTINGS
        @given(body=bodies(keys, sampling), who=st.sampled_from(sorted(targets)))
        def one(body: tuple[str, bytes], who: str) -> None:
            base, allowed = targets[who]
            ctype, raw = body
            r = client.post(base + path, content=raw, headers={"content-type": ctype})
            check(r, f"{who} {path} {raw[:200]!r}", allowed)

        one()
        for base, _ in targets.values():
            assert client.get(base + "/health").status_code == 200


def test_ops_routes_of_router_and_nodes(cluster: tuple[LocalCluster, str]) -> None:
    c, url = cluster
    bases = [url, c.prefills[0].url, c.decodes[0].url]
    with httpx.Client(timeout=TIMEOUT_S) as client:
        @SETTINGS
        @given(body=bodies(["rid", "abort_all", "role", "url", "bootstrap_port"]), base=st.sampled_from(bases),
               path=st.sampled_from(["/abort_request", "/flush_cache", "/workers"]))
        def post(body: tuple[str, bytes], base: str, path: str) -> None:
            if path == "/workers" and base != url:
                path = "/abort_request"  # nodes have no worker list
            ctype, raw = body
            r = client.post(base + path, content=raw, headers={"content-type": ctype})
            check(r, f"POST {base}{path} {raw[:200]!r}")
            if path == "/workers" and r.status_code < 300:  # a valid-looking worker got in: take it out again
                client.request("DELETE", url + "/workers", json=json.loads(raw))

        @SETTINGS
        @given(path=st.sampled_from(["/get_load", "/debug/memory", "/server_info", "/v1/models", "/metrics",
                                     "/health", "/workers", "/dashboard/data"]),
               query=st.dictionaries(st.text(max_size=6), st.text(max_size=10), max_size=3), base=st.sampled_from(bases))
        def get(path: str, query: dict, base: str) -> None:
            r = client.get(base + path, params=query)
            check(r, f"GET {base}{path}?{query}")

        post()
        get()
        workers = client.get(url + "/workers").json()["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"], workers


def test_bootstrap_registry_routes(cluster: tuple[LocalCluster, str]) -> None:
    c, _ = cluster
    base = f"http://127.0.0.1:{c.prefills[0].bootstrap_port}"
    keys = ["rank_ip", "rank_port", "engine_rank", "dp_group", "tp_size", "dp_size", "page_size", "kv_layout",
            "session_id", "instance_id", "role", "system_dp_rank", "attn_tp_size"]
    with httpx.Client(timeout=TIMEOUT_S) as client:
        @SETTINGS
        @given(body=bodies(keys), method=st.sampled_from(["PUT", "DELETE"]),
               query=st.dictionaries(st.sampled_from(["engine_rank", "target_dp_group", "dp_group", "x"]), EDGE.map(str),
                                     max_size=3))
        def one(body: tuple[str, bytes], method: str, query: dict) -> None:
            ctype, raw = body
            r = client.request(method, base + "/route", content=raw, params=query, headers={"content-type": ctype})
            check(r, f"{method} /route {raw[:200]!r} {query}")
            g = client.get(base + "/route", params=query)
            check(g, f"GET /route {query}")

        one()
        assert client.get(base + "/health").status_code == 200
