"""The fence against a paused prefill, real processes over the real Mooncake TCP engine.

A prefill is stopped (SIGSTOP, by the fault-injection hook ``PDC_FAULT_STOP_BEFORE_WRITE_ROOM``)
right before its engine write for room A. The decode declares it dead after the heartbeat bound,
fails A to its client after the quarantine, and then serves concurrent requests through a second
prefill. Their pages are the ones A had (the allocator hands out the head of the one free run of
an idle pool: A's 6 pages cover all three 2-page prompts) unless A's pages are fenced. Once every
concurrent request decodes, the stopped prefill is resumed: its write for A lands at once, into
each of their prompts (two of them at other positions than A's). Every concurrent request must still equal HF greedy token for token,
and every node ends back at idle (A's pages released once the resumed prefill answered).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.cluster import Cluster, check_greedy, memory, next_room, running_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Heartbeat bound 0.5 s x (3 + 1) = 2 s, then 1 s of quarantine: A fails ~3 s after the pause.
ENV = {"PDC_BOOTSTRAP_TIMEOUT_S": "30", "PDC_WAITING_TIMEOUT_S": "60", "PDC_HEARTBEAT_INTERVAL_S": "0.5",
       "PDC_HEARTBEAT_MAX_FAILURES": "3", "PDC_HUNG_PEER_QUARANTINE_S": "1"}
PROMPT_A = [(11 * k + 3) % 500 + 10 for k in range(96)]  # 6 pages of 16
PROMPTS_B = [[(7 * k + 5 * i + 1) % 500 + 10 for k in range(32)] for i in range(3)]  # 2 pages each
N_B = 160  # long enough that every B is still decoding when the stale write lands


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str) -> Iterator[Cluster]:
    with running_cluster(tiny_qwen3, decode_args=["--max-total-tokens", "1024"], env=ENV) as c:
        yield c


def gen_body(prompt: list[int], n: int, **extra: object) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}


def test_a_resumed_prefill_cannot_write_into_pages_given_to_other_requests(cluster: Cluster) -> None:
    room_a = next_room()
    stale, stale_boot = cluster.start_prefill(env={**ENV, "PDC_FAULT_STOP_BEFORE_WRITE_ROOM": str(room_a)})
    resumed = threading.Event()

    def resume() -> None:
        if not resumed.is_set():
            resumed.set()
            os.killpg(stale.proc.pid, signal.SIGCONT)  # the scheduler process is the stopped one

    try:
        with ThreadPoolExecutor(8) as ex:
            body_a = cluster.body(gen_body(PROMPT_A, 8), room=room_a, bootstrap_port=stale_boot)
            prefill_a = ex.submit(httpx.post, stale.url + "/generate", json={**body_a, "stream": True}, timeout=120)
            t0 = time.monotonic()
            decode_a = httpx.post(cluster.decode.url + "/generate", json=body_a, timeout=60)
            assert decode_a.status_code == 503 and "KV transfer failed" in decode_a.text, decode_a.text
            assert time.monotonic() - t0 < 20, "the client of the paused prefill waited past the bound"
            held = memory(cluster.decode.url)  # the fence, as operators see it

            started = [0]
            lock = threading.Lock()

            def on_event(seen: set[int], i: int) -> object:
                def cb(ev: dict) -> bool:
                    if ev.get("output_ids") and i not in seen:
                        seen.add(i)
                        with lock:
                            started[0] += 1
                            if started[0] == len(PROMPTS_B):
                                resume()  # every B decodes from its pages: now the stale write lands
                    return True
                return cb

            seen: set[int] = set()
            streams = [ex.submit(cluster.pd_stream, "/generate", gen_body(p, N_B), 120, on_event(seen, i))
                       for i, p in enumerate(PROMPTS_B)]
            results = [s.result(timeout=300) for s in streams]
            assert resumed.is_set(), "the concurrent requests finished before the prefill was resumed"
            for i, (p, events, status) in enumerate(results):
                assert p.status_code == 200 and status == 200, events[-1:]
                final = [e for e in events if "output_ids" in e][-1]
                check_greedy(cluster.model_dir, PROMPTS_B[i], final["output_ids"], N_B, f"request B{i} beside the stale write")
            prefill_a.result(timeout=120)  # the resumed prefill finishes A (its answer is moot)
        assert held.get("fenced_reqs") == 1 and held.get("fenced_pages") == 6, held
        assert held["free_pages"] == held["total_pages"] - 6, held
    finally:
        resume()
    cluster.wait_idle()  # A's pages came back once the resumed prefill answered for its room
    assert memory(cluster.decode.url).get("fenced_reqs") == 0
