"""Exact cache-aware routing end to end: two prefill nodes with small KV pools and two decode nodes
with their prefix cache on publish their radix caches' KV events; our router (``--tokenizer-path``,
cache-aware on both roles) subscribes, indexes them and predicts each request's prefill cache hit
and decode prefix hit. Fake data plane (no KV bytes move: routing is what is tested) and a tiny
qwen3; one cluster for the module, with a cluster secret (sealed events, signed snapshots).

    test_prediction_*   multi-turn conversations whose histories overflow the pools (so the caches
                        evict): for every request the router's predicted hit equals the cached
                        tokens the prefill reported (router metrics), and each turn goes to the
                        prefill holding its history
    test_chat_*         chat turns: the router renders the chat template as the nodes do
    test_decode_*       a conversation's next turn goes to the decode holding it, which reuses
                        exactly the tokens the router predicted; /flush_cache clears both roles
    test_restarted_*    a new router process resyncs from the snapshots and routes as before
"""
from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from common.tools.local_cluster import LocalCluster
from common.auth import signed_headers
from tests.e2e.cluster import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGE = 16
# 20 pages: two conversations of 4 turns (~50 tokens each) on one prefill no longer fit, and by the
# pigeonhole principle 3 conversations put two on one of the 2 prefills.
POOL = ["--max-total-tokens", str(20 * PAGE), "--max-running-requests", "4"]
ROUTER_ARGS = ["--policy", "cache-aware", "--health-check-interval-s", "0.5", "--request-timeout-s", "60"]
SECRET = "kv-routing-e2e-secret-0123456789"
ROUTER = [""]  # the module's router URL, once started
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def metrics(url: str) -> str:
    """The router's /metrics (open: this router has no API key); a node's needs a request token."""
    headers = signed_headers(SECRET, "GET", url + "/metrics") if url != ROUTER[0] else {}
    return httpx.get(url + "/metrics", timeout=10, headers=headers).text


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every series of ``name``."""
    return {m.group(1) or "": float(m.group(2)) for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)}


def label(labels: str, name: str) -> str:
    m = re.search(rf'{name}="([^"]*)"', labels)
    assert m is not None, labels
    return m.group(1)


def wait_synced(url: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(samples(metrics(url), "pdc_router_kv_index_synced").values()) < n:
        assert time.monotonic() < deadline, "the router's KV indexes did not sync"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def kv_cluster(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    model_dir = tiny_model_factory("qwen3")
    # With a cluster secret: the events are sealed and the snapshot needs a request token.
    cluster = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-kv-routing")), cluster_secret=SECRET, api_key=None,
                           operator_key=None)
    try:
        cluster.start(model_dir, backend="fake", page_size=PAGE, num_prefill=2, num_decode=2, prefill_args=POOL,
                      decode_args=["--disaggregation-decode-enable-radix-cache"],
                      router_args=[*ROUTER_ARGS, "--tokenizer-path", model_dir], startup_timeout_s=180)
        ROUTER[0] = cluster.router_url  # type: ignore[assignment]
        wait_synced(cluster.router_url, 4)  # type: ignore[arg-type]
        yield cluster
    except BaseException:
        print(cluster.log_tails(60))
        raise
    finally:
        cluster.stop()


def turn_text(conv: int, turns: int) -> str:
    """Conversation ``conv`` after ``turns`` turns: each turn appends a few dozen tokens."""
    return " ".join(f"[{conv}.{t}] " + " ".join(WORDS[(conv * 7 + t * 3 + i) % len(WORDS)] for i in range(12))
                    for t in range(turns + 1))


def send(url: str, text: str) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def send_streamed(url: str, text: str) -> dict:
    """/generate streamed: its last data frame (cumulative, with the request's meta_info)."""
    body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "stream": True}
    last: dict = {}
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last


def node_metric(url: str, name: str) -> float:
    """A node's scheduler gauge (its series carry the node's labels)."""
    return sum(samples(metrics(url), name).values())


@dataclass(frozen=True)
class RouterCounts:
    """The router's exact predictions, predicted and reported cached tokens, and prefill tries per
    worker, from one scrape. The reported figure is the prefill's own answer: with the fake data
    plane the decode's meta_info has no aux row to read it from."""

    exact: float
    predicted: float
    reported: float
    routed: dict[str, float]

    @staticmethod
    def scrape(url: str) -> RouterCounts:
        text = metrics(url)
        routed = {label(k, "worker"): v for k, v in samples(text, "pdc_router_worker_routed_total").items()
                  if 'role="prefill"' in k}
        return RouterCounts(samples(text, "pdc_router_kv_predictions_total").get('outcome="exact"', 0.0),
                            samples(text, "pdc_router_kv_predicted_tokens_total").get("", 0.0),
                            samples(text, "pdc_router_kv_reported_cached_tokens_total").get("", 0.0), routed)

    def since(self, before: RouterCounts) -> tuple[float, float, float, str]:
        """(exact, predicted, reported, the prefill it went to) of the one request in between."""
        (went,) = [u for u, n in self.routed.items() if n > before.routed.get(u, 0)]
        return self.exact - before.exact, self.predicted - before.predicted, self.reported - before.reported, went


def test_prediction_equals_the_reported_hit_through_evictions(kv_cluster: LocalCluster) -> None:
    url = kv_cluster.router_url
    assert url is not None
    owner: dict[int, str] = {}  # conversation -> the prefill its first turn went to
    cached = []
    counts = RouterCounts.scrape(url)
    for turn in range(4):
        for conv in range(3):
            send(url, turn_text(conv, turn))
            before, counts = counts, RouterCounts.scrape(url)
            exact, predicted, reported, went = counts.since(before)
            assert exact == 1 and predicted == reported, f"turn {turn} of {conv}: predicted {predicted}, got {reported}"
            if reported > 0:
                assert went == owner[conv], f"turn {turn} of conversation {conv} left the prefill holding it"
            owner.setdefault(conv, went)
            cached.append(reported)
    assert sum(c > 0 for c in cached) >= 3, f"later turns should hit their history: {cached}"
    removed = sum(node_metric(p.url, "pdc_scheduler_kv_events_removed_blocks_total") for p in kv_cluster.prefills)
    assert removed > 0, "the small pools should have evicted"
    drops = {k: v for k, v in samples(metrics(url), "pdc_router_kv_events_total").items()
             if any(f'verdict="{d}"' in k for d in ("malformed", "unauthenticated", "replayed", "gap", "silent"))}
    assert not drops, drops
    for p in kv_cluster.prefills:
        wait_idle(p.url, secret=SECRET)


def test_chat_turns_are_rendered_by_the_router_and_predicted_exactly(kv_cluster: LocalCluster) -> None:
    """The router renders the chat template as the nodes do: turn 2 hits turn 1's prompt."""
    url = kv_cluster.router_url
    assert url is not None
    history = [{"role": "user", "content": turn_text(7, 1)}]
    reported = []
    decodes = [d.url for d in kv_cluster.decodes]
    for reply in (None, "a short answer"):
        if reply is not None:
            history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        before = RouterCounts.scrape(url)
        reused0 = sum(node_metric(d, "pdc_decode_reused_tokens_total") for d in decodes)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": history, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        exact, predicted, got, _ = RouterCounts.scrape(url).since(before)
        assert exact == 1 and predicted == got, f"chat: predicted {predicted}, the prefill reported {got}"
        reported.append(got)
        # usage reports the decode's own hit beside the prefill's (which the fake data plane's
        # missing aux row leaves at 0 on the decode), as the decodes counted it
        details = r.json()["usage"]["prompt_tokens_details"]
        reused = sum(node_metric(d, "pdc_decode_reused_tokens_total") for d in decodes) - reused0
        assert details["decode_reused_tokens"] == reused, (details, reused)
    assert reported[1] >= 64, reported  # turn 1's prompt (~100 tokens) served from the cache


def test_restarted_router_resyncs_from_the_snapshot_and_routes_as_before(kv_cluster: LocalCluster) -> None:
    url = kv_cluster.router_url
    assert url is not None
    for p in kv_cluster.prefills:
        info = httpx.get(p.url + "/server_info", headers=signed_headers(SECRET, "GET", p.url + "/server_info"),
                         timeout=10).json()["kv_events"]
        assert info["sealed"] is True and info["endpoint"] == f"tcp://127.0.0.1:{info['port']}"
        assert httpx.get(p.url + "/kv_events/snapshot", timeout=10).status_code == 401  # no request token
    send(url, turn_text(23, 3))  # something cached, whichever tests ran before this one
    for p in kv_cluster.prefills:
        wait_idle(p.url, secret=SECRET)
    nodes = [*kv_cluster.prefills, *kv_cluster.decodes]
    blocks = {n.url: node_metric(n.url, "pdc_scheduler_kv_events_blocks") for n in nodes}
    kv_cluster.kill("router")
    kv_cluster._spawn("router", kv_cluster.argv["router"])
    deadline = time.monotonic() + 30
    while not kv_cluster._all_workers_healthy():
        assert time.monotonic() < deadline, "the router did not come back"
        time.sleep(0.2)
    wait_synced(url, 4)
    text = metrics(url)
    index = {label(k, "worker"): v for k, v in samples(text, "pdc_router_kv_index_blocks").items()}
    assert index == blocks and sum(blocks.values()) > 0
    assert all(samples(text, "pdc_router_kv_events_total").get(f'verdict="snapshot",worker="{p.url}"', 0) >= 1
               for p in nodes)
    # The prompt sent above, again: it goes where it is cached, predicted exactly.
    before = RouterCounts.scrape(url)
    send(url, turn_text(23, 3))
    exact, predicted, reported, went = RouterCounts.scrape(url).since(before)
    assert exact == 1 and predicted == reported > 0 and blocks[went] > 0


def decode_counts(url: str) -> tuple[float, float, dict[str, float]]:
    """The router's exact decode picks, predicted decode hits (tokens), and requests per decode."""
    text = metrics(url)
    routed = {label(k, "worker"): v for k, v in samples(text, "pdc_router_worker_routed_total").items()
              if 'role="decode"' in k}
    return (samples(text, "pdc_router_kv_decode_picks_total").get('mode="exact"', 0.0),
            samples(text, "pdc_router_kv_decode_predicted_tokens_total").get("", 0.0), routed)


def wait_index_caught_up(url: str, d: str) -> None:
    """A turn's pages reach the decode's cache when it releases the request; wait until the
    router's index shows what the decode's own log holds."""
    deadline = time.monotonic() + 30
    while True:
        held = node_metric(d, "pdc_scheduler_kv_events_blocks")
        index = {label(k, "worker"): v for k, v in samples(metrics(url), "pdc_router_kv_index_blocks").items()}
        if held > 0 and index.get(d) == held:
            return
        assert time.monotonic() < deadline, f"the router's index of {d} never caught up: {index.get(d)} vs {held}"
        time.sleep(0.1)


def test_decode_turns_go_to_the_decode_holding_the_conversation(kv_cluster: LocalCluster) -> None:
    """Turn 2 of a new conversation lands on the decode that served turn 1 (its prefix cache
    holds turn 1's prompt, per its KV events), that decode reuses tokens instead of receiving
    them, and the router predicted exactly how many (the decode's own counter is the reference)."""
    url = kv_cluster.router_url
    assert url is not None
    decodes = [d.url for d in kv_cluster.decodes]

    def reused() -> dict[str, float]:
        return {d: node_metric(d, "pdc_decode_reused_tokens_total") for d in decodes}

    went, hits = [], []
    for turn in (1, 2):  # turn 1's prompt (~40 tokens) leaves two whole pages in its decode's cache
        before_reused, (picks0, predicted0, routed0) = reused(), decode_counts(url)
        outcomes0 = samples(metrics(url), "pdc_router_kv_decode_predictions_total")
        answer = (send if turn == 1 else send_streamed)(url, turn_text(11, turn))  # turn 2 streamed
        picks, predicted, routed = decode_counts(url)
        (d,) = [u for u, n in routed.items() if n > routed0.get(u, 0)]
        after = reused()
        got = {u: after[u] - before_reused[u] for u in decodes}
        assert picks - picks0 == 1 and predicted - predicted0 == sum(got.values()), (turn, predicted - predicted0, got)
        # The decode's answer reports its own hit, and our router passes it on unchanged.
        assert answer["meta_info"]["decode_reused_tokens"] == got[d], (turn, answer["meta_info"], got)
        # ... and the router compared it with its prediction, per request (the stream's last frame too).
        outcomes = samples(metrics(url), "pdc_router_kv_decode_predictions_total")
        grew = {k: v - outcomes0.get(k, 0.0) for k, v in outcomes.items() if v != outcomes0.get(k, 0.0)}
        assert grew == {'outcome="exact"': 1.0}, (turn, grew)
        went.append(d)
        hits.append(got[d])
        wait_index_caught_up(url, d)
    assert went[1] == went[0], f"turn 2 left the decode holding turn 1: {went}"
    assert hits[0] == 0 and hits[1] >= 2 * PAGE, hits
    for d in decodes:
        wait_idle(d, secret=SECRET)
    # /flush_cache through the router clears both roles' caches; each node publishes "cleared"
    # and the router's index of it empties.
    nodes = [n.url for n in (*kv_cluster.prefills, *kv_cluster.decodes)]
    cleared = {n: node_metric(n, "pdc_scheduler_kv_events_cleared_total") for n in nodes}
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    assert all(node_metric(n, "pdc_scheduler_kv_events_cleared_total") == cleared[n] + 1 for n in nodes)
    deadline = time.monotonic() + 30
    while any(samples(metrics(url), "pdc_router_kv_index_blocks").values()):
        assert time.monotonic() < deadline, "the router's index kept blocks after /flush_cache"
        time.sleep(0.1)


def test_a_next_turn_within_the_local_bound_goes_to_its_decode_alone(
        kv_cluster: LocalCluster, tiny_model_factory: Callable[..., str]) -> None:
    """A second router with --decode-local-prefill-tokens 24. Turn 1 (40 tokens, none cached) goes
    through a prefill. Turns 2 and 3 leave at most 24 tokens past what their decode holds: each goes
    to that decode alone (no prefill, no room), which reuses exactly the predicted prefix and
    computes the rest. A turn asking for prompt logprobs (the prefill computes those) goes through
    a prefill whatever it leaves."""
    model_dir = tiny_model_factory("qwen3")
    url = kv_cluster.start_router("router-local", [n.name for n in kv_cluster.nodes],
                                  [*ROUTER_ARGS, "--tokenizer-path", model_dir, "--decode-local-prefill-tokens", "24"])
    wait_synced(url, 4)
    rng = random.Random(5)
    prompt = [rng.randrange(100, 1000) for _ in range(40)]

    def counts() -> tuple[float, dict[str, float], dict[str, float]]:
        text = metrics(url)
        routed = samples(text, "pdc_router_worker_routed_total")
        return (samples(text, "pdc_router_decode_local_total").get('endpoint="generate"', 0.0),
                {label(k, "worker"): v for k, v in routed.items() if 'role="prefill"' in k},
                {label(k, "worker"): v for k, v in routed.items() if 'role="decode"' in k})

    went: list[str] = []
    cached_upto = 0  # what the conversation's decode holds: whole pages of its last prompt + answer - 1
    for turn, logprob in ((1, False), (2, False), (3, False), (4, True)):
        local0, prefills0, decodes0 = counts()
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": logprob}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        local, prefills, decodes = counts()
        (d,) = [u for u, n in decodes.items() if n > decodes0.get(u, 0)]
        went.append(d)
        prefilled = sum(prefills.values()) - sum(prefills0.values())
        if turn in (2, 3):
            assert (local - local0, prefilled) == (1, 0), (turn, meta)
            held = min(cached_upto, (len(prompt) - 1) // PAGE * PAGE)
            assert 0 < len(prompt) - held <= 24, (turn, len(prompt), held)
            assert (meta["decode_reused_tokens"], meta["decode_computed_tokens"]) == (held, len(prompt) - held), meta
        else:
            assert (local - local0, prefilled) == (0, 1), (turn, meta)
            assert "decode_computed_tokens" not in meta, meta
        wait_index_caught_up(url, d)
        out = r.json()["output_ids"]
        cached_upto = (len(prompt) + len(out) - 1) // PAGE * PAGE
        prompt = prompt + out + [rng.randrange(100, 1000) for _ in range(8)]
    assert len(set(went)) == 1, f"the conversation left its decode: {went}"
    for n in (*kv_cluster.prefills, *kv_cluster.decodes):
        wait_idle(n.url, secret=SECRET)
