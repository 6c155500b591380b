"""Per-request stage timelines through our router: 1 prefill + 1 decode (real Mooncake over TCP,
tiny qwen3).

For a streamed and a non-streamed /generate, and for an OpenAI chat completion that asks for it
(``"return_timeline": true``), the answer carries a timeline whose stages add up to the router's
end-to-end time, and that end-to-end time sits within a few milliseconds of what this client
measured around the request (so no stage hides time the router did not see). The decode's
stages are its own measurements; the prefill's are nested. An OpenAI request that does not ask
gets a standard body. The stage histograms reach both /metrics pages; the test ends with both
nodes back at idle memory.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from common.timeline import DECODE_STAGES, PREFILL_STAGES
from common.tools.local_cluster import LocalCluster
from router.timeline import ROUTER_STAGES
from tests.e2e.cluster import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TIMEOUT_S = 60.0
# Client-measured time minus the router's e2e: the client's own HTTP hop to the router and back.
CLIENT_HOP_MS = 15.0
PROMPT = {"input_ids": [11, 12, 13, 14, 15, 16, 17, 18] * 4, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}


@pytest.fixture(scope="module")
def cluster(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str]]:
    c = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-timeline-e2e")))
    try:
        url = c.start(tiny_model_factory("qwen3"), backend="mooncake", num_prefill=1, num_decode=1, router="ours",
                      startup_timeout_s=180)
        assert url is not None
        httpx.post(url + "/generate", json=PROMPT, timeout=TIMEOUT_S).raise_for_status()  # warm-up
        yield c, url
        for n in c.nodes:
            wait_idle(n.url)
    except BaseException:
        print(c.log_tails(60))
        raise
    finally:
        c.stop()


def check(timeline: dict, client_ms: float) -> None:
    stages = timeline["stages_ms"]
    names = list(stages)
    assert names[:2] == ["router_pick", "decode_hop"] and names[-1] == "router_out", names
    assert names[2:-1] == [f"decode.{s}" for s in ("api_in", *DECODE_STAGES, "api_out")], names
    assert set(ROUTER_STAGES) <= set(names)
    assert all(v >= 0 for v in stages.values()), stages
    total = sum(stages.values())
    assert abs(total - timeline["e2e_ms"]) < 0.01 * len(stages) + 0.01, (total, timeline)  # rounding only
    assert 0 <= client_ms - timeline["e2e_ms"] < CLIENT_HOP_MS, (client_ms, timeline)
    decode = timeline["decode"]
    assert decode["role"] == "decode" and decode["forwards"] == 11  # 12 tokens: the first from the prefill
    prefill = timeline["prefill"]
    assert prefill["role"] == "prefill" and list(prefill["stages_ms"]) == ["api_in", *PREFILL_STAGES, "api_out"]
    assert prefill["forwards"] == 1
    # The prefill's work happens while the decode waits for the KV (both legs leave together): its
    # forward ends before the KV can land. Only that much is causal; the prefill's transfer stage
    # ends when its scheduler next polls, and its answer goes back after that (a loaded CI box
    # delayed both by 20 ms past the decode's Success).
    d, p = decode["stages_ms"], prefill["stages_ms"]
    before_write = p["api_in"] + p["bootstrap"] + p["queue"] + p["forward"]
    assert before_write <= timeline["stages_ms"]["decode_hop"] + d["api_in"] + d["prealloc"] + d["kv_transfer"] + 5.0


def timed(fn: Callable[[], httpx.Response], timeline: Callable[[httpx.Response], dict]) -> tuple[httpx.Response, float]:
    """The response and the client's wall time of the call. The hop outside the timeline (client
    <-> router) is a few ms, but a loaded 2-core box can stall the client process for tens of ms:
    up to 3 tries, keeping the first whose gap is within the bound. A timeline that leaves time
    out fails every try."""
    for _ in range(3):
        t0 = time.monotonic()
        r = fn()
        ms = (time.monotonic() - t0) * 1000.0
        if r.status_code != 200 or 0 <= ms - timeline(r)["e2e_ms"] < CLIENT_HOP_MS:
            break
    return r, ms


def test_generate_whole_answer_carries_a_timeline_that_adds_up(cluster: tuple[LocalCluster, str]) -> None:
    _, url = cluster
    with httpx.Client(timeout=TIMEOUT_S) as client:
        r, ms = timed(lambda: client.post(url + "/generate", json=PROMPT), lambda r: r.json()["meta_info"]["timeline"])
    assert r.status_code == 200, r.text
    check(r.json()["meta_info"]["timeline"], ms)


def sse_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]


def test_generate_stream_carries_the_timeline_on_its_last_event(cluster: tuple[LocalCluster, str]) -> None:
    _, url = cluster
    with httpx.Client(timeout=TIMEOUT_S) as client:
        r, ms = timed(lambda: client.post(url + "/generate", json={**PROMPT, "stream": True}),
                      lambda r: sse_events(r)[-1]["meta_info"]["timeline"])
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert all("timeline" not in e["meta_info"] for e in events[:-1])
    check(events[-1]["meta_info"]["timeline"], ms)


def test_openai_chat_timeline_only_when_asked(cluster: tuple[LocalCluster, str]) -> None:
    _, url = cluster
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT_S) as client:
        plain = client.post(url + "/v1/chat/completions", json=body)
        assert plain.status_code == 200 and "timeline" not in plain.text
        r, ms = timed(lambda: client.post(url + "/v1/chat/completions", json={**body, "return_timeline": True}),
                      lambda r: r.json()["choices"][0]["timeline"])
        assert r.status_code == 200, r.text
        check(r.json()["choices"][0]["timeline"], ms)
        s, ms = timed(lambda: client.post(url + "/v1/chat/completions",
                                          json={**body, "return_timeline": True, "stream": True}),
                      lambda s: next(c for c in sse_events(s) if c["choices"] and "timeline" in c["choices"][0])
                      ["choices"][0]["timeline"])
        chunks = sse_events(s)
        with_tl = [c for c in chunks if c["choices"] and "timeline" in c["choices"][0]]
        assert len(with_tl) == 1 and with_tl[0]["choices"][0]["finish_reason"] is not None
        check(with_tl[0]["choices"][0]["timeline"], ms)


def test_stage_histograms_reach_both_metrics_pages(cluster: tuple[LocalCluster, str]) -> None:
    c, url = cluster
    router = httpx.get(url + "/metrics", timeout=10).text
    assert 'pdc_router_stage_seconds_count{endpoint="generate",stage="decode.kv_transfer"}' in router
    node = httpx.get(c.decodes[0].url + "/metrics", timeout=10).text
    assert "pdc_api_stage_seconds_count" in node and 'stage="first_token"' in node
    node = httpx.get(c.prefills[0].url + "/metrics", timeout=10).text
    assert 'stage="bootstrap"' in node and 'stage="transfer"' in node
