"""The API process for real: uvicorn in a subprocess (tests/integration/_api_process.py: the
``run_api_server`` a node launcher calls), linked over ZMQ ipc to a fake scheduler process
(tests/integration/_fake_scheduler.py), driven over loopback HTTP.

The fake scheduler's tokens are predictable: token k of a request is
``ALPHABET[(sum(input_ids) + k) % len(ALPHABET)]`` — so every expected text below is the tokenizer's
own decode of ids computed here, independent of the server. The fake logs every message it gets,
which is how the tests see what reached the scheduler (and what did not).

This file: the ops endpoints, /generate and the OpenAI endpoints. test_api_process_errors (which
imports the helpers from here) covers bad input, failed transfers, disconnects, duplicate rids
and aborts, the prefill role and, last, the scheduler's death. The nodes both files drive are
the session's (tests/integration/conftest.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.ipc.protocol import IpcEndpoints
from common.ipc.scheduler_client import client_rid
from common.ports import free_port
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORDS = [" cache", " node", " page", " the", " token"]
STARTUP_S = 90.0


@dataclass
class Node:
    url: str
    log: Path
    api: subprocess.Popen
    fake: subprocess.Popen
    stderr: Path
    stderr_file: Any

    def received(self, kind: str | None = None) -> list[dict]:
        lines = [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]
        return [m for m in lines if kind is None or m.get("type") == kind]

    def wait_received(self, kind: str, pred: Any, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.received(kind):
                if pred(m):
                    return m
            time.sleep(0.05)
        raise AssertionError(f"no {kind} message matching within {timeout} s; got {self.received()}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def spawn_node(tmp: Path, model_dir: str, role: str, alphabet: list[int], step_s: float,
               watch_scheduler: bool = False, extra: tuple[str, ...] = ()) -> Node:
    """Start the fake scheduler and the API process (``extra``: more flags of _api_process.py);
    ``wait_healthy`` waits for them."""
    tmp.mkdir(parents=True, exist_ok=True)
    ep = IpcEndpoints.fresh(str(tmp))
    log, stderr = tmp / "fake.jsonl", tmp / "stderr.txt"
    log.touch()
    env = dict(os.environ, PDC_LOG_LEVEL="WARNING")
    err = open(stderr, "w")
    fake = subprocess.Popen(
        [sys.executable, str(HERE / "_fake_scheduler.py"), "--to-scheduler", ep.to_scheduler,
         "--from-scheduler", ep.from_scheduler, "--log", str(log), "--alphabet", ",".join(map(str, alphabet)),
         "--role", role, "--step-s", str(step_s)], cwd=REPO, env=env, stdout=err, stderr=err)
    port = free_port()
    cmd = [sys.executable, str(HERE / "_api_process.py"), "--role", role, "--model-path", model_dir,
           "--port", str(port), "--to-scheduler", ep.to_scheduler, "--from-scheduler", ep.from_scheduler,
           "--disaggregation-bootstrap-port", "8123", "--health-generate-timeout", "5", *extra]
    if watch_scheduler:
        cmd += ["--scheduler-pid", str(fake.pid)]
    try:
        api = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=err, stderr=err)
    except BaseException:
        _kill(fake)
        raise
    return Node(f"http://127.0.0.1:{port}", log, api, fake, stderr, err)


def wait_healthy(node: Node) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        for p in (node.api, node.fake):
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args[:3]} exited early:\n{node.stderr.read_text()}")
        try:
            if httpx.get(node.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"API not healthy in {STARTUP_S} s:\n{node.stderr.read_text()}")
        time.sleep(0.2)


def stop_node(node: Node) -> None:
    for p in (node.api, node.fake):
        _kill(p)
    node.stderr_file.close()


def expected_ids(alphabet: list[int], prompt_ids: list[int], n: int) -> list[int]:
    return [alphabet[(sum(prompt_ids) + k) % len(alphabet)] for k in range(n)]


def sse_events(resp: httpx.Response) -> list[Any]:
    """Parse an SSE body; the final element is the string "[DONE]"."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    out: list[Any] = []
    for block in resp.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out and out[-1] == "[DONE]"
    return out


def post(node: Node, path: str, body: Any, timeout: float = 30) -> httpx.Response:
    return httpx.post(node.url + path, json=body, timeout=timeout)


def post_once_free(node: Node, body: dict, timeout: float = 2.0) -> httpx.Response:
    """POST, retrying while the API still holds the rid (it frees it when it notices the disconnect)."""
    deadline = time.monotonic() + timeout
    while True:
        r = post(node, "/generate", body)
        if r.status_code != 400 or "already in flight" not in r.text or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


# ---- ops endpoints ------------------------------------------------------------------------------


def test_ops_endpoints(decode: Node, tiny_qwen3: str) -> None:
    get = lambda p: httpx.get(decode.url + p, timeout=10)  # noqa: E731
    assert get("/health").status_code == 200
    info = get("/server_info").json()
    assert info == {**get("/get_server_info").json(), "uptime_s": info["uptime_s"]}
    assert info["disaggregation_mode"] == "decode" and info["disaggregation_bootstrap_port"] == 8123
    assert info["model_path"] == tiny_qwen3 and info["dp_size"] == 1 and info["context_length"] == 2048
    model = get("/model_info").json()
    assert model == get("/get_model_info").json()
    assert model["architectures"] == ["Qwen3ForCausalLM"] and model["model_type"] == "qwen3"
    assert model["is_generation"] is True and model["tokenizer_path"] == tiny_qwen3
    assert get("/v1/models").json()["data"][0]["id"] == tiny_qwen3
    assert get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert get("/debug/memory").json()["free_pages"] == 100
    flushed = httpx.post(decode.url + "/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    assert get("/health_generate").status_code == 200
    health_req = decode.received("generate")[-1]
    assert health_req["rid"].startswith("HEALTH_CHECK_") and health_req["bootstrap_room"] is None
    metrics = get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'pdc_scheduler_up{model_name="' in text and "} 1\n" in text.split("pdc_scheduler_up{")[1][:200]
    assert "pdc_scheduler_token_usage" in text and "pdc_scheduler_gen_throughput" in text
    assert "pdc_scheduler_not_a_number" not in text
    assert "pdc_api_generation_tokens_total" in text and "pdc_api_inflight_sequences" in text


# ---- /generate ----------------------------------------------------------------------------------


def test_generate_whole_and_stream(decode: Node, tok: Tokenizer, alphabet: list[int]) -> None:
    prompt = "the cache node"
    pids = tok.encode(prompt)
    want = expected_ids(alphabet, pids, 6)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "rid": "gen-1",
            "return_logprob": True}
    r = post(decode, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == want and out["text"] == tok.decode(want)
    meta = out["meta_info"]
    assert meta["id"] == "gen-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(pids), 6)
    assert [x[1] for x in meta["output_token_logprobs"]] == want
    sent = decode.wait_received("generate", lambda m: client_rid(m["rid"]) == "gen-1")
    assert sent["input_ids"] == pids and sent["sampling"]["max_new_tokens"] == 6 and sent["sampling"]["return_logprob"]

    s = post(decode, "/generate", {**body, "rid": "gen-2", "stream": True})
    events = sse_events(s)[:-1]
    assert [e["text"] for e in events] == [tok.decode(want[:k]) for k in range(1, 7)]  # cumulative
    assert events[-1]["output_ids"] == want and events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch_with_n(decode: Node, tok: Tokenizer, alphabet: list[int]) -> None:
    r = post(decode, "/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 3, "n": 2,
                                                                                    "seed": 70}})
    items = r.json()
    assert isinstance(items, list) and [it["index"] for it in items] == [0, 1, 2, 3]
    for it, prompt in zip(items, [[5, 6], [5, 6], [7], [7]]):
        assert it["output_ids"] == expected_ids(alphabet, prompt, 3)
    sent = sorted((m["input_ids"], m["sampling"]["seed"]) for m in decode.received("generate")
                  if m["sampling"].get("seed") in (70, 71))
    assert sent == [([5, 6], 70), ([5, 6], 71), ([7], 70), ([7], 71)]  # sample j: seed + j


def test_stop_string_and_stop_token(decode: Node, tok: Tokenizer, alphabet: list[int]) -> None:
    pids = [5]
    want = expected_ids(alphabet, pids, 8)
    full = tok.decode(want)
    stop = tok.decode([want[3]])[:3]  # the first characters of the 4th token
    r = post(decode, "/generate", {"input_ids": pids, "sampling_params": {"max_new_tokens": 8, "stop": [stop]}})
    assert r.json()["text"] == full[: full.index(stop)]
    r = post(decode, "/generate", {"input_ids": pids, "sampling_params": {"max_new_tokens": 8,
                                                                          "stop_token_ids": [want[2]]}})
    out = r.json()
    assert out["output_ids"] == want[:3] and out["text"] == tok.decode(want[:2])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[2]}


# ---- OpenAI -------------------------------------------------------------------------------------


def test_completions_whole_vs_stream(decode: Node, tok: Tokenizer, alphabet: list[int]) -> None:
    body = {"model": None, "prompt": ["the", "cache"], "max_completion_tokens": 5, "n": 2, "temperature": 0.5,
            "logprobs": 1, "ignore_eos": True, "top_k": 3, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 4}
    whole = post(decode, "/v1/completions", body).json()
    assert whole["object"] == "text_completion"
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    for i, p in enumerate(["the", "the", "cache", "cache"]):
        assert texts[i] == tok.decode(expected_ids(alphabet, tok.encode(p), 5))
    p_tokens = len(tok.encode("the")) + len(tok.encode("cache"))
    assert whole["usage"]["prompt_tokens"] == p_tokens and whole["usage"]["completion_tokens"] == 20
    events = sse_events(post(decode, "/v1/completions", {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    streamed: dict[int, str] = {}
    for e in events[:-2]:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == texts
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    sent = [m for m in decode.received("generate") if m["input_ids"] == tok.encode("the")][-2:]
    assert [m["sampling"].get("seed") for m in sent] == [4, 5]
    assert sent[0]["sampling"]["top_k"] == 3 and sent[0]["sampling"]["ignore_eos"] is True


def test_chat_router_style_n2(decode: Node, tok: Tokenizer, alphabet: list[int]) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    body = {"model": "unknown", "messages": msgs, "max_completion_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": False, "tools": None,
            "bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [None, 9999],
            "bootstrap_room": [2**63 - 1, 77]}
    events = sse_events(post(decode, "/v1/chat/completions", body))
    want = tok.decode(expected_ids(alphabet, tok.apply_chat_template(msgs), 4))
    for idx in (0, 1):
        mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == idx]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == want
        assert mine[-1]["finish_reason"] == "length"
    sent = [m for m in decode.received("generate") if m["bootstrap_room"] in (2**63 - 1, 77)]
    assert [(m["bootstrap_room"], m["bootstrap_port"], m["stream"]) for m in sent] == \
        [(2**63 - 1, 8123, True), (77, 9999, True)]
    whole = post(decode, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4}).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": want}
