"""A running prefill node (real Mooncake over TCP): router-shaped requests, failures, bad input, aborts.

Requests are shaped as sglang-router sends them to a prefill (docs/PROTOCOL.md §1): ``stream: true``,
``bootstrap_port: null``, batches with parallel room lists, OpenAI bodies with extra fields.
Each failure scenario must end with the room failed within its configured bound,
``/debug/memory`` back at the idle baseline, and the node still serving a normal request.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import _decode_peer
from _decode_peer import DecodePeer, PrefillNodeProc
from common.kvcache.pool import KVLayout
from transfer import KVPoll

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.integration

BOOTSTRAP_TIMEOUT_S = 2.0  # PDC_BOOTSTRAP_TIMEOUT_S of the node under test
SLACK_S = 3.0  # scheduling, HTTP and loaded-CI jitter on top of a bound
PAGE = 16
MAX_TOTAL_TOKENS = 1024


@pytest.fixture(scope="module")
def node(tiny_qwen3: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefillNodeProc]:
    log = str(tmp_path_factory.mktemp("prefill-failure") / "node.log")
    n = PrefillNodeProc(tiny_qwen3, "--disaggregation-transfer-backend", "mooncake", "--page-size", str(PAGE),
                        "--chunked-prefill-size", "16", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
                        env={"PDC_BOOTSTRAP_TIMEOUT_S": str(BOOTSTRAP_TIMEOUT_S), "PDC_LOG_LEVEL": "INFO"}, log_path=log)
    try:
        n.wait_ready()
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def layout(tiny_qwen3: str) -> KVLayout:
    with open(os.path.join(tiny_qwen3, "config.json")) as f:
        cfg = json.load(f)
    return KVLayout(cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], PAGE, "float32")


@pytest.fixture(scope="module")
def peer(node: PrefillNodeProc, layout: KVLayout) -> Iterator[DecodePeer]:
    p = DecodePeer(layout)
    try:
        yield p
    finally:
        p.close()


def body(room: int | None, ids: list[int], **extra: Any) -> dict:
    b: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **extra}
    if room is not None:
        b.update(bootstrap_host="127.0.0.1", bootstrap_room=room)  # bootstrap_port: the node's default
    return b


def post(node: PrefillNodeProc, payload: dict, timeout_s: float = 30.0) -> httpx.Response:
    return httpx.post(f"{node.url}/generate", content=json.dumps(payload), timeout=timeout_s)


def memory_settles(node: PrefillNodeProc, timeout_s: float = 5.0) -> dict:
    """/debug/memory once nothing is in flight; asserts it is the idle baseline."""
    deadline = time.monotonic() + timeout_s
    mem = node.get("/debug/memory")
    while (mem["live_reqs"] or mem["transfer_rooms"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        mem = node.get("/debug/memory")
    assert mem["live_reqs"] == 0 and mem["held_pages"] == 0 and mem["transfer_rooms"] == 0, mem
    assert mem["free_req_slots"] == mem["total_req_slots"] and mem["locked_pages"] == 0, mem
    assert mem["free_pages"] + mem["cached_pages"] == mem["total_pages"], mem
    return mem


def still_serves(node: PrefillNodeProc, peer: DecodePeer, seed: int) -> None:
    room, resp = peer.generate(node, [(seed * 7 + i) % 900 + 5 for i in range(40)])
    assert resp.status_code == 200, resp.text
    assert room.state is KVPoll.Success, room.reason
    peer.release(room)
    memory_settles(node)


def test_decode_never_connects_fails_within_the_bootstrap_timeout(node: PrefillNodeProc, peer: DecodePeer) -> None:
    memory_settles(node)
    t0 = time.monotonic()
    resp = post(node, body(peer.new_room(), list(range(5, 45))))
    elapsed = time.monotonic() - t0
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]["message"]
    assert "room" in err and "bootstrap timeout" in err, err
    assert BOOTSTRAP_TIMEOUT_S * 0.8 <= elapsed < BOOTSTRAP_TIMEOUT_S + SLACK_S, elapsed
    memory_settles(node)
    still_serves(node, peer, seed=1)


def test_decode_killed_after_the_handshake_fails_the_room_and_frees_it(node: PrefillNodeProc, peer: DecodePeer,
                                                                        layout: KVLayout) -> None:
    """The decode reserved pages and sent TransferInfo, then died before the prefill wrote."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=_decode_peer.serve_child, args=(child_end, dataclasses.asdict(layout)), daemon=True)
    child.start()
    try:
        assert conn.poll(120), "decode child did not start"
        assert conn.recv() == ("ok", "ready")
        rooms = [peer.new_room() for _ in range(3)]
        for room in rooms:
            conn.send(("open", room, f"127.0.0.1:{node.bootstrap_port}", 40))
            assert conn.poll(30)
            assert conn.recv() == ("ok", "Transferring")  # TransferInfo is out: the prefill may write
    finally:
        if child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    # The router's half of each request arrives only now, so every write goes to a dead decode.
    results: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, post(node, body(r, list(range(7, 47))))))
               for r in rooms]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    assert sorted(results) == sorted(rooms)
    for room, resp in results.items():
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]["message"]
        assert f"room {room}" in err and "KV transfer failed" in err, err
    assert elapsed < SLACK_S + 5.0, f"dead decode detected only after {elapsed:.1f} s"  # 5 s: the write timeout
    memory_settles(node)
    still_serves(node, peer, seed=2)


def test_bad_input_gets_400_and_touches_no_pool(node: PrefillNodeProc, peer: DecodePeer) -> None:
    before = memory_settles(node)
    too_big = [5 + i % 900 for i in range(MAX_TOTAL_TOKENS + PAGE)]  # fits the context, not the KV pool
    cases = {
        "kv pool": body(peer.new_room(), too_big),
        "local": body(None, [5, 6, 7]),  # a prefill node decodes nothing: max_new_tokens 4 is refused
        "empty": body(peer.new_room(), []),
        "temperature": {**body(peer.new_room(), [5, 6]), "sampling_params": {"temperature": -1}},
        "vocab": body(peer.new_room(), [5, 10**6]),
    }
    expect = {"kv pool": "KV pages", "local": "router", "empty": "", "temperature": "temperature", "vocab": "vocabulary"}
    for name, payload in cases.items():
        resp = post(node, payload)
        assert resp.status_code == 400, (name, resp.text)
        msg = resp.json()["error"]["message"]
        assert msg and expect[name] in msg, (name, msg)
    after = memory_settles(node)
    assert after == before
    ok = post(node, body(None, [5, 6, 7], sampling_params={"max_new_tokens": 1, "temperature": 0.0}))
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 1  # a local check runs the model
    assert httpx.get(f"{node.url}/health_generate", timeout=10).status_code == 200


def test_abort_while_waiting_for_the_decode_releases_everything(node: PrefillNodeProc, peer: DecodePeer) -> None:
    memory_settles(node)
    rid = "abort-me"
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.__setitem__("r", post(node, {**body(peer.new_room(), [5] * 30), "rid": rid})))
    t.start()
    deadline = time.monotonic() + 5
    # Computed ahead (the node's default --compute-ahead-fraction), it waits for the decode parked.
    while node.get("/debug/memory")["parked_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.get("/debug/memory")["parked_reqs"] == 1 and node.get("/get_load")[0]["num_reqs"] == 1
    r = httpx.post(f"{node.url}/abort_request", json={"rid": rid}, timeout=5)
    assert r.status_code == 200 and r.json() == {"aborted": [rid]}
    t.join(10)
    assert not t.is_alive()
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    memory_settles(node)
    still_serves(node, peer, seed=3)


def sse_events(text: str) -> list[str]:
    return [frame[len("data: "):] for frame in text.split("\n\n") if frame.startswith("data: ")]


def test_router_shaped_requests(node: PrefillNodeProc, peer: DecodePeer) -> None:
    ids = [(11 * i) % 900 + 5 for i in range(37)]
    # 1. /generate, streamed, bootstrap_port null (the node's default): SSE after the transfer
    room = peer.new_room()
    payload = {"input_ids": ids, "stream": True, "model": None, "rid": None,
               "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
               "bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": room}
    (r,), resp = peer.request(node, "/generate", payload, [(room, len(ids))])
    assert resp.status_code == 200 and r.state is KVPoll.Success, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    peer.release(r)
    # 2. a batch: parallel lists, one room per item
    a, b = ids[:20], ids[5:]
    rooms = [peer.new_room(), peer.new_room()]
    payload = {"input_ids": [a, b], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
               "bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [None, None], "bootstrap_room": rooms}
    got, resp = peer.request(node, "/generate", payload, [(rooms[0], len(a)), (rooms[1], len(b))])
    assert resp.status_code == 200, resp.text
    assert [g.state for g in got] == [KVPoll.Success, KVPoll.Success]
    out = resp.json()
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(a), len(b)]
    for g in got:
        peer.release(g)
    # 3. OpenAI completions with token-id prompt, extras and unknown fields, streamed with usage
    room = peer.new_room()
    payload = {"model": "unknown", "prompt": ids, "max_tokens": 8, "stream": True, "temperature": 0,
               "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 1, "some_new_field": {"x": 1},
               "bootstrap_host": "127.0.0.1", "bootstrap_port": node.bootstrap_port, "bootstrap_room": room}
    (r,), resp = peer.request(node, "/v1/completions", payload, [(room, len(ids))])
    assert resp.status_code == 200 and r.state is KVPoll.Success, resp.text
    assert sse_events(resp.text)[-1] == "[DONE]"
    peer.release(r)
    memory_settles(node)
    metrics = httpx.get(f"{node.url}/metrics", timeout=10).text
    for name in ("pdc_scheduler_num_transfer_reqs", "pdc_scheduler_token_usage", "pdc_scheduler_finished_reqs_total"):
        assert name in metrics, name


def test_start_up_failures_exit_with_a_reason(tiny_qwen3: str, tmp_path) -> None:
    """Bad flags: 2; bootstrap port taken or a scheduler that cannot load the model: 1 — never a node
    that serves 503 forever. The three launches run side by side to save time."""
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(os.path.join(tiny_qwen3, "config.json"), broken / "config.json")  # no weights
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        runs = {
            "bad flag": (["--model-path", str(tmp_path / "missing")], 2, "is not a directory"),
            "port taken": (["--model-path", tiny_qwen3, "--disaggregation-bootstrap-port", str(taken)], 1,
                           "cannot serve the bootstrap registry"),
            "no weights": (["--model-path", str(broken)], 1, "scheduler failed to start"),
        }
        procs = {}
        try:
            for name, (flags, _, _) in runs.items():
                cmd = [sys.executable, "-m", "prefill_node", "--disaggregation-transfer-backend", "fake",
                       "--port", str(_decode_peer.free_port()), *flags]
                if "--disaggregation-bootstrap-port" not in flags:
                    cmd += ["--disaggregation-bootstrap-port", str(_decode_peer.free_port())]
                procs[name] = subprocess.Popen(cmd, cwd=_decode_peer.ROOT, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)
            for name, (_, code, reason) in runs.items():
                out, _ = procs[name].communicate(timeout=120)
                assert procs[name].returncode == code, (name, out[-2000:])
                assert reason in out, (name, out[-2000:])
        finally:
            for pr in procs.values():
                if pr.poll() is None:
                    pr.kill()
                    pr.wait(10)

def test_scheduler_death_turns_health_503_and_fails_requests(node: PrefillNodeProc) -> None:
    """Last in this module: it kills the node's scheduler."""
    assert node.scheduler_pid is not None
    os.kill(node.scheduler_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    status = 200
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = httpx.get(f"{node.url}/health", timeout=5).status_code
    assert status == 503
    assert httpx.get(f"http://127.0.0.1:{node.bootstrap_port}/health", timeout=5).status_code == 503
    resp = post(node, body(12345, [5, 6, 7]), timeout_s=10)
    assert resp.status_code == 503 and "scheduler" in resp.json()["error"]["message"]
