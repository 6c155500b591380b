"""The real sglang-router 0.3.2 in PD mode in front of one prefill and one decode node (Mooncake
over TCP): docs/PROTOCOL.md §1 says our worker API must work behind it unmodified, so every request here
goes to the router's port only. Greedy answers of ``/generate`` (single, batch, streamed),
``/v1/completions`` and ``/v1/chat/completions`` (streamed and not) equal HF, alone and
concurrently; structured outputs (response_format, /generate's regex) pass through and equal HF
with the grammar applied; requests the nodes refuse come back as a 4xx; both nodes end at idle memory.

The router runs from ``.venv-router`` (``make router-venv``, its own venv so its pins never meet
ours) or from the interpreter named by ``PDC_TEST_SGLANG_ROUTER_PYTHON``; without a usable one
the module skips and says why.

Router 0.3.2 behaviour this pins down (measured, not ours to change):
- ``/generate`` with a ``text`` list is refused by the router itself (422, its schema has
  ``text: String``), so batches here are ``input_ids`` lists.
- ``/generate`` and ``/v1/completions`` with ``n > 1`` reach the nodes with one scalar
  ``bootstrap_room`` for n sequences; the nodes give sequence i room + i, as SGLang does. A
  ``/generate`` batch with ``n > 1`` gets one room per prompt for k*n sequences: refused, 400.
- At start-up it probes each worker with an HTTP/2 (gRPC) preface before falling back to HTTP/1.1;
  uvicorn logs "Invalid HTTP request received" for each probe, which is harmless.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from common.tokenizer import Tokenizer
from tests.e2e.cluster import REPO, Cluster, Node, check_greedy, check_greedy_text, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROUTER_VERSION = "0.3.2"
ROUTER_PYTHON_ENV = "PDC_TEST_SGLANG_ROUTER_PYTHON"  # test config only: which interpreter has the router
ROUTER_READY_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0


def _router_python() -> str:
    return os.environ.get(ROUTER_PYTHON_ENV) or os.path.join(REPO, ".venv-router", "bin", "python")


@pytest.fixture(scope="module")
def router_python() -> str:
    """The interpreter with sglang-router 0.3.2, or a skip naming what is missing (checked before
    any node starts)."""
    python = _router_python()
    if not os.path.exists(python):
        pytest.skip(f"no sglang-router interpreter at {python}: run `make router-venv` (needs PyPI) or set "
                    f"{ROUTER_PYTHON_ENV}")
    probe = ("import importlib.metadata as m, sglang_router.launch_router; "
             "print(m.version('sglang-router'))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{python} cannot run the sglang-router probe: {exc}")
    if out.returncode != 0:
        pytest.skip(f"{python} cannot import sglang_router (run `make router-venv`): {out.stderr.strip()[-300:]}")
    version = out.stdout.strip()
    if version != ROUTER_VERSION:
        pytest.skip(f"{python} has sglang-router {version}; the worker API is pinned to {ROUTER_VERSION}")
    return python


def start_router(python: str, cluster: Cluster) -> Node:
    """sglang-router in PD mode over the cluster's two nodes, in its own session (killed by group)."""
    port, metrics_port = free_port(), free_port()
    log_path = os.path.join(os.path.dirname(cluster.prefill.log_path), f"router-{port}.log")
    cmd = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--prefill", cluster.prefill.url, str(cluster.bootstrap_port), "--decode", cluster.decode.url,
           "--host", "127.0.0.1", "--port", str(port),
           # Its metrics port defaults to a fixed 29000, which parallel test runs would fight over.
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--health-check-interval-secs", "5",  # as deploy/k8s/base/router.yaml
           "--shutdown-grace-period-secs", "1",  # the default 180 s would stall the teardown
           "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Node("router", f"http://127.0.0.1:{port}", proc, log_path)


def wait_router_ready(router: Node, workers: int, timeout_s: float = ROUTER_READY_TIMEOUT_S) -> None:
    """``/readiness`` is 200 once the router has registered healthy workers; bounded, and fails at
    once with the router's log if it exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if router.proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {router.proc.returncode}:\n{router.log_tail()}")
        try:
            r = httpx.get(router.url + "/readiness", timeout=2)
            last = f"{r.status_code} {r.text[:200]}"
            if r.status_code == 200 and r.json().get("healthy_workers") == workers:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"sglang-router not ready within {timeout_s:g} s (last: {last}):\n{router.log_tail()}")
        time.sleep(0.2)


@dataclass
class Routed:
    cluster: Cluster
    url: str  # the router's; nothing in the tests talks to a node except the final memory checks
    model: str  # the served model name, as the router's /v1/models reports it
    tok: Tokenizer

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=REQUEST_TIMEOUT_S)

    def stream(self, path: str, body: dict) -> list[dict]:
        """The SSE events of a streamed answer, after checking the framing byte for byte:
        ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``."""
        r = httpx.post(self.url + path, json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        frames = r.text.split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""], r.text[-200:]
        assert all(f.startswith("data: ") and "\n" not in f for f in frames[:-2]), r.text
        return [json.loads(f[len("data: "):]) for f in frames[:-2]]


@pytest.fixture(scope="module")
def routed(router_python: str, qwen3_pair: Cluster) -> Iterator[Routed]:
    """sglang-router in front of the session's qwen3 pair (tests/e2e/conftest.py); the router is
    this module's, killed when it is done."""
    router = start_router(router_python, qwen3_pair)
    try:
        wait_router_ready(router, workers=2)
        models = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
        yield Routed(qwen3_pair, router.url, models[0]["id"], Tokenizer(qwen3_pair.model_dir))
    finally:
        router.kill(grace_s=5)


# ---- one request of each shape: send it, check it against HF ----------------------------------


@dataclass
class Job:
    path: str
    body: dict
    prompt: list[int]  # what the node tokenizes the request to, for the HF reference
    n: int  # max new tokens (ignore_eos, so exactly n)
    stream: bool


def generate_job(prompt: list[int], n: int, stream: bool = False) -> Job:
    return Job("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                      "ignore_eos": True}}, prompt, n, stream)


def completion_job(r: Routed, text: str, n: int, stream: bool) -> Job:
    body = {"model": r.model, "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True} if stream else None}
    return Job("/v1/completions", body, r.tok.encode(text), n, stream)


def chat_job(r: Routed, content: str, n: int, stream: bool) -> Job:
    msgs = [{"role": "user", "content": content}]
    body = {"model": r.model, "messages": msgs, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True} if stream else None}
    return Job("/v1/chat/completions", body, list(r.tok.apply_chat_template(msgs, add_generation_prompt=True)),
               n, stream)


def run_job(r: Routed, job: Job) -> tuple[list[int] | str, dict]:
    """(output ids or text, {finish, completion tokens, prompt tokens}) of one routed request."""
    if job.path == "/generate":
        if job.stream:
            events = r.stream(job.path, job.body)
            assert len(events) > 1 or job.n == 1  # incremental chunks (cumulative), not one blob
            out = events[-1]
        else:
            resp = r.post(job.path, job.body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
        meta = out["meta_info"]
        assert out["text"] == r.tok.decode(out["output_ids"])
        return out["output_ids"], {"finish": meta["finish_reason"]["type"], "completion": meta["completion_tokens"],
                                   "prompt": meta["prompt_tokens"]}
    chat = job.path == "/v1/chat/completions"
    if job.stream:
        events = r.stream(job.path, job.body)
        usage = events[-1]["usage"]  # include_usage: a last chunk with no choices
        assert events[-1]["choices"] == [] and all(e["choices"] for e in events[:-1])
        pieces = [(e["choices"][0]["delta"].get("content") or "") if chat else e["choices"][0]["text"]
                  for e in events[:-1]]
        text, finish = "".join(pieces), events[-2]["choices"][0]["finish_reason"]
    else:
        resp = r.post(job.path, job.body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        choice, usage = out["choices"][0], out["usage"]
        assert len(out["choices"]) == 1
        text, finish = (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    return text, {"finish": finish, "completion": usage["completion_tokens"], "prompt": usage["prompt_tokens"]}


def check_job(r: Routed, job: Job, got: list[int] | str, meta: dict, what: str) -> None:
    assert meta == {"finish": "length", "completion": job.n, "prompt": len(job.prompt)}, (what, meta)
    if isinstance(got, list):
        check_greedy(r.cluster.model_dir, job.prompt, got, job.n, what)
    else:
        check_greedy_text(r.cluster.model_dir, r.tok.decode, job.prompt, got, job.n, what)


def run_and_check(r: Routed, job: Job) -> None:
    got, meta = run_job(r, job)
    check_job(r, job, got, meta, f"{job.path} stream={job.stream}")


# ---- tests -------------------------------------------------------------------------------------


def test_generate_single_text_and_input_ids_batch_match_hf(routed: Routed) -> None:
    text = "the router sends both nodes"
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    resp = routed.post("/generate", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    prompt = routed.tok.encode(text)
    assert out["meta_info"]["prompt_tokens"] == len(prompt)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["decode_reused_tokens"] == 0  # the decode's answer, as it is (it keeps no cache)
    check_greedy(routed.cluster.model_dir, prompt, out["output_ids"], 6, "/generate text")

    # A batch: the router sends parallel lists of bootstrap hosts/ports/rooms, one room per item.
    prompts = [[17], [5, 9, 300, 41, 7, 2, 88], [(i * 37) % 900 + 3 for i in range(20)]]  # 20 crosses a page
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    resp = routed.post("/generate", body)
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o["meta_info"]["prompt_tokens"] == len(p) and o["meta_info"]["completion_tokens"] == 5
        check_greedy(routed.cluster.model_dir, p, o["output_ids"], 5, f"/generate batch item {i}")
    run_and_check(routed, generate_job([11, 42, 7, 99], 5, stream=True))
    routed.cluster.wait_idle()


def test_completions_match_hf(routed: Routed) -> None:
    for stream in (False, True):
        run_and_check(routed, completion_job(routed, "disaggregated serving splits", 6, stream))
    routed.cluster.wait_idle()


def test_n_samples_with_the_routers_single_room_match_hf(routed: Routed) -> None:
    # The router sends one scalar room here for all n sequences (chat gets a list of n).
    resp = routed.post("/generate", {"input_ids": [8, 16, 32], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}})
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert len(outs) == 2
    for i, o in enumerate(outs):
        check_greedy(routed.cluster.model_dir, [8, 16, 32], o["output_ids"], 4, f"/generate n=2 sample {i}")
    job = completion_job(routed, "one room each", 4, stream=False)
    resp = routed.post(job.path, {**job.body, "n": 2})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 8
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "decode_reused_tokens": 0}, out["usage"]
    for c in out["choices"]:
        check_greedy_text(routed.cluster.model_dir, routed.tok.decode, job.prompt, c["text"], 4, "/v1/completions n=2")
    routed.cluster.wait_idle()


def test_chat_completions_stream_and_not_match_hf(routed: Routed) -> None:
    for stream in (False, True):
        run_and_check(routed, chat_job(routed, "héllo prefill, meet decode", 6, stream))
    routed.cluster.wait_idle()


def test_concurrent_mixed_requests_match_hf(routed: Routed) -> None:
    jobs = [generate_job([3 + i, 50 + i, 700 - i] * (i + 1), 4 + i % 3, stream=i % 2 == 1) for i in range(4)]
    jobs += [completion_job(routed, f"pages and rooms {i}", 5, stream=i == 1) for i in range(2)]
    jobs += [chat_job(routed, f"KV cache number {i}", 5, stream=i == 0) for i in range(2)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(lambda j: run_job(routed, j), jobs))
    for i, (job, (got, meta)) in enumerate(zip(jobs, results)):
        check_job(routed, job, got, meta, f"job {i} {job.path} stream={job.stream}")
    routed.cluster.wait_idle()


def test_structured_outputs_behind_sglang_router(routed: Routed) -> None:
    """response_format (chat, streamed and not) and /generate's regex survive the router's
    rebuilt bodies: the acceptance run of tests/e2e/grammar_schemas.py (GRAMMAR_REQUESTS, 20 by
    default: one per schema) validates and equals HF generate with the grammar as a logits processor."""
    from tests.e2e import grammar_schemas as grammar
    from tests.e2e.cluster import NEAR_TIE
    from tests.reference import hf_greedy_constrained

    def send(job: grammar.Job) -> tuple[str, str | None]:
        body = job.body(routed.model)
        if job.stream:
            return grammar.sse_chat(routed.stream("/v1/chat/completions", body))
        out = routed.post("/v1/chat/completions", body)
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["message"]["content"], out.json()["choices"][0]["finish_reason"]

    model_dir = routed.cluster.model_dir
    jobs = grammar.plan(grammar.requests_from_env(20))
    t0 = time.monotonic()
    results = grammar.run(jobs, send)
    print(f"sglang-router: {len(jobs)} structured requests in {time.monotonic() - t0:.1f} s")
    grammar.check(jobs, results, model_dir, routed.tok, NEAR_TIE)
    regex = "(cache|node|room)-[0-9]{2,4}"
    gen = routed.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                                "regex": regex}})
    assert gen.status_code == 200, gen.text
    want_ids, _ = hf_greedy_constrained(model_dir, [5, 6, 7], 20, "regex", regex)
    assert gen.json()["output_ids"] == want_ids and gen.json()["meta_info"]["finish_reason"]["type"] == "stop"
    routed.cluster.wait_idle()


def test_refused_requests_are_4xx_through_the_router_and_leak_nothing(routed: Routed) -> None:
    bad = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": -1}}
    resp = routed.post("/generate", bad)
    assert resp.status_code == 400 and "temperature" in resp.text, (resp.status_code, resp.text)
    # A batch with n > 1: the router sends 2 rooms for 4 sequences; refused rather than guessed.
    two = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}}
    resp = routed.post("/generate", two)
    assert resp.status_code == 400 and "2 entries for 4 sequences" in resp.text, (resp.status_code, resp.text)
    routed.cluster.wait_idle()
    run_and_check(routed, generate_job([5, 6, 7], 3))  # neither node is wedged
    routed.cluster.wait_idle()
