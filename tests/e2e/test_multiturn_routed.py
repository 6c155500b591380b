"""Multi-turn conversations behind our router, as issue 23's acceptance runs them: two prefills and
two decodes (decode prefix cache on), real Mooncake over TCP, the tiny llama, and two routers of
ours over the same nodes, both with exact cache-aware routing on both roles (``--tokenizer-path``):
one sends every turn through a prefill, the other (``--decode-local-prefill-tokens 32``) sends a
turn whose decode holds all but at most 32 of its tokens to that decode alone. A conversation's
turns alternate between the routers, streamed and not, one request at a time, so each node's
counters around a request are that request's.

For every turn: the output is HF greedy for its whole prompt; it lands on the decode holding its
conversation, which reuses exactly the previous turn's whole pages (``decode_reused_tokens``);
through a prefill, only the pages past that prefix cross the wire (the decodes' token and byte
counters); alone on its decode, nothing crosses and the decode computes the rest itself
(``decode_computed_tokens``, ``pdc_decode_local_prefill_tokens_total``). At the end every node is
idle, and after ``/flush_cache`` through a router every cache is empty. Last, a decode dies just
before a next turn is sent to it alone: the router retries that turn through a prefill.

MULTITURN_CONVERSATIONS x MULTITURN_TURNS scale it (CI: 3 x 4; ``make multiturn-acceptance``: 32 x 6).
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from common.tokenizer import Tokenizer
from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import check_greedy, memory, page_nbytes, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PAGE = 16
LOCAL_BOUND = 32
ROUTER_ARGS = ["--policy", "cache-aware", "--health-check-interval-s", "0.5", "--request-timeout-s", "60"]
DECODE_COUNTERS = ("pdc_decode_transferred_tokens_total", "pdc_decode_reused_tokens_total",
                   "pdc_decode_transferred_bytes_total", "pdc_decode_local_prefill_tokens_total")


def series(url: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every series of ``name`` in ``url``'s /metrics (open: no secret here)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)}


def total(url: str, name: str) -> float:
    return sum(series(url, name).values())


def wait_indexes(routers: list[str], nodes: list[str], timeout_s: float = 30.0) -> None:
    """Until every router's index of every node holds what that node's KV-event log holds: a turn's
    pages reach its decode's cache as it ends, and the next turn's pick must see them."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {n: total(n, "pdc_scheduler_kv_events_blocks") for n in nodes}
        views = [{re.search(r'worker="([^"]*)"', k).group(1): v  # type: ignore[union-attr]
                  for k, v in series(r, "pdc_router_kv_index_blocks").items()} for r in routers]
        if all(view.get(n) == held[n] for view in views for n in nodes):
            return
        assert time.monotonic() < deadline, f"the routers' indexes never caught up: {views} vs {held}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def routed(tiny_model_factory: Callable[..., str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str, str, str]]:
    """(cluster, model dir, the router through prefills, the router with the local path)."""
    model_dir = tiny_model_factory("llama")
    cluster = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-multiturn-routed")), cluster_secret=None,
                           api_key=None, operator_key=None)
    try:
        exact = cluster.start(model_dir, backend="mooncake", page_size=PAGE, num_prefill=2, num_decode=2,
                              decode_args=["--disaggregation-decode-enable-radix-cache"],
                              router_args=[*ROUTER_ARGS, "--tokenizer-path", model_dir], startup_timeout_s=180)
        assert exact is not None
        local = cluster.start_router("router-local", [n.name for n in cluster.nodes],
                                     [*ROUTER_ARGS, "--tokenizer-path", model_dir,
                                      "--decode-local-prefill-tokens", str(LOCAL_BOUND)])
        deadline = time.monotonic() + 30
        while any(sum(series(r, "pdc_router_kv_index_synced").values()) < 4 for r in (exact, local)):
            assert time.monotonic() < deadline, "the routers' KV indexes did not sync"
            time.sleep(0.2)
        yield cluster, model_dir, exact, local
    except BaseException:
        print(cluster.log_tails(60))
        raise
    finally:
        cluster.stop()


def _send(url: str, body: dict, stream: bool) -> tuple[list[int], dict]:
    """(output ids, meta_info) of one /generate through a router."""
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]
    last: dict = {}
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last["output_ids"], last["meta_info"]


def test_multiturn_behind_the_router_matches_hf_and_moves_only_the_new_pages(
        routed: tuple[LocalCluster, str, str, str]) -> None:
    cluster, model_dir, exact, local = routed
    decodes = [d.url for d in cluster.decodes]
    nodes = [n.url for n in (*cluster.prefills, *cluster.decodes)]
    nbytes = page_nbytes(model_dir, PAGE)
    convs = int(os.environ.get("MULTITURN_CONVERSATIONS", "3"))
    turns = int(os.environ.get("MULTITURN_TURNS", "4"))
    rng = random.Random(29)
    vocab = Tokenizer(model_dir).vocab_size  # what the nodes accept as token ids

    def counters() -> list[float]:
        return [sum(total(d, name) for d in decodes) for name in DECODE_COUNTERS]

    went_local = went_pd = 0
    for c in range(convs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 41))]
        cached_upto = 0  # what the conversation's decode holds: whole pages of its last prompt + answer - 1
        for t in range(turns):
            url = local if (c + t) % 2 else exact
            n, stream = rng.randrange(5, 10), (c + t // 2) % 2 == 1
            what = f"conversation {c} turn {t} prompt_len={len(prompt)} stream={stream} via {url}"
            wait_indexes([exact, local], nodes)
            before = counters()
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            got, meta = _send(url, body, stream)
            check_greedy(model_dir, prompt, got, n, what)
            after = counters()
            sent, reused, sent_bytes, computed = (a - b for a, b in zip(after, before))
            want_reused = min(cached_upto, (len(prompt) - 1) // PAGE * PAGE)
            rest = len(prompt) - want_reused
            assert meta["decode_reused_tokens"] == want_reused == reused, (what, meta, reused)
            if url == local and rest <= LOCAL_BOUND:  # on its decode alone: nothing crossed the wire
                went_local += 1
                assert meta["decode_computed_tokens"] == rest == computed, (what, meta, computed)
                assert (sent, sent_bytes) == (0, 0), (what, sent, sent_bytes)
            else:  # through a prefill: only the pages past the decode's reused prefix
                went_pd += 1
                assert "decode_computed_tokens" not in meta and computed == 0, (what, meta)
                assert sent == rest and sent_bytes == (-(-len(prompt) // PAGE) - want_reused // PAGE) * nbytes, \
                    (what, sent, sent_bytes)
            cached_upto = (len(prompt) + len(got) - 1) // PAGE * PAGE
            prompt = prompt + got + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 21))]
    assert went_local > 0 and went_pd > 0, (went_local, went_pd)
    for n in nodes:
        wait_idle(n)
    assert httpx.post(exact + "/flush_cache", timeout=30).status_code == 200
    for n in nodes:
        mem = memory(n)
        assert mem["cached_pages"] == 0 and mem["free_pages"] == mem["total_pages"], (n, mem)


def test_a_local_turn_whose_decode_died_is_retried_through_a_prefill(
        routed: tuple[LocalCluster, str, str, str]) -> None:
    """Runs last: it kills a decode. A next turn picked for its decode alone, sent just after that
    decode died (before a health probe could notice), fails to connect; the router takes the dead
    decode out of rotation and retries through a prefill and the live decode. The client gets the
    HF-exact answer, and the live nodes end idle."""
    cluster, model_dir, _, local = routed
    rng = random.Random(31)
    vocab = Tokenizer(model_dir).vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(40)]  # > the bound: turn 1 goes through a prefill
    decodes = {d.url: d.name for d in cluster.decodes}
    nodes = [n.url for n in (*cluster.prefills, *cluster.decodes)]
    before = {d: total(d, "pdc_decode_transferred_tokens_total") for d in decodes}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    got, _ = _send(local, body, stream=False)
    (holder,) = [d for d in decodes if total(d, "pdc_decode_transferred_tokens_total") > before[d]]
    wait_indexes([local], nodes)
    prompt = prompt + got + [rng.randrange(3, vocab) for _ in range(8)]  # 52 tokens, 32 of them held: 20 to compute
    local0 = total(local, "pdc_router_decode_local_total")
    retries0 = total(local, "pdc_router_retries_total")
    cluster.kill(decodes[holder])
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    got, meta = _send(local, body, stream=True)
    check_greedy(model_dir, prompt, got, 5, "the retried turn")
    assert "decode_computed_tokens" not in meta and meta["decode_reused_tokens"] == 0, meta  # via a prefill
    assert total(local, "pdc_router_decode_local_total") - local0 == 1  # the first try went to the dead decode
    assert total(local, "pdc_router_retries_total") - retries0 == 1
    for n in nodes:
        if n != holder:
            wait_idle(n)
