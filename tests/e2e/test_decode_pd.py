"""A prefill node and a decode node, real Mooncake over TCP, driven as sglang-router drives them:
greedy outputs equal HF ``generate`` token for token (near-tie rule), for concurrent mixed requests
on both tiny archs; then every node returns to its idle memory baseline.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common import kernels
from tests.e2e.cluster import NEAR_TIE, Cluster, check_greedy, memory, page_nbytes
from tests.reference import hf_greedy, hf_logits

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

def _tokenizer(model_dir: str):  # type: ignore[no-untyped-def]
    from common.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def test_concurrent_mixed_requests_match_hf(pd_cluster: Cluster) -> None:
    tok = _tokenizer(pd_cluster.model_dir)
    rng = random.Random(7)
    vocab = tok.vocab_size
    jobs = []
    for i in range(20):
        n = rng.randrange(2, 14)
        stream = i % 2 == 1
        if i % 4 < 2:  # native /generate on token ids, lengths 1..70
            prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 33, 70]))]
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            jobs.append(("/generate", body, prompt, n, stream))
        else:  # OpenAI chat
            msgs = [{"role": "user", "content": " ".join(rng.choice(["disaggregated", "prefill", "decode", "KV",
                                                                       "cache", "pages", "héllo", "日本"])
                                                            for _ in range(rng.randrange(1, 12)))}]
            prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
            body = {"model": None, "messages": msgs, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True} if stream else None}
            jobs.append(("/v1/chat/completions", body, prompt, n, stream))

    def run(job: tuple) -> tuple[list[int] | str, dict]:
        path, body, _, _, stream = job
        if not stream:
            p, d = pd_cluster.pd(path, body)
            assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
            out = d.json()
            if path == "/generate":
                return out["output_ids"], {"finish": out["meta_info"]["finish_reason"]["type"],
                                           "completion": out["meta_info"]["completion_tokens"]}
            return out["choices"][0]["message"]["content"], {"finish": out["choices"][0]["finish_reason"],
                                                             "completion": out["usage"]["completion_tokens"]}
        p, events, status = pd_cluster.pd_stream(path, body)
        assert p.status_code == 200 and status == 200, (p.text, events[-1:])
        assert events[-1] == {"done": True}
        if path == "/generate":
            last = events[-2]
            assert len(events) > 2  # incremental chunks, not one blob
            return last["output_ids"], {"finish": last["meta_info"]["finish_reason"]["type"],
                                        "completion": last["meta_info"]["completion_tokens"]}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e.get("choices"))
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1]
        return text, {"finish": finish, "completion": events[-2]["usage"]["completion_tokens"]}

    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(run, jobs))
    for i, (job, (got, meta)) in enumerate(zip(jobs, results)):
        path, _, prompt, n, stream = job
        what = f"job {i} {path} stream={stream} prompt_len={len(prompt)}"
        assert meta == {"finish": "length", "completion": n}, (what, meta)
        if isinstance(got, list):
            check_greedy(pd_cluster.model_dir, prompt, got, n, what)
        else:
            want, gaps = hf_greedy(pd_cluster.model_dir, prompt, n)
            tie = next((k for k, g in enumerate(gaps) if g < NEAR_TIE), n)
            assert got.startswith(tok.decode(want[:tie])), (what, got, tok.decode(want))
            if tie == n:
                assert got == tok.decode(want), (what, got, tok.decode(want))
    pd_cluster.wait_idle()


def test_logprobs_first_from_prefill_then_decode_match_hf(pd_cluster: Cluster) -> None:
    prompt = [11, 42, 7, 99, 300, 5]
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    p, d = pd_cluster.pd("/generate", body)
    assert p.status_code == 200 and d.status_code == 200, d.text
    meta = d.json()["meta_info"]
    ids = d.json()["output_ids"]
    check_greedy(pd_cluster.model_dir, prompt, ids, 5, "logprobs request")
    logp = torch.log_softmax(hf_logits(pd_cluster.model_dir, prompt + ids), dim=-1)  # [T, vocab]
    for k, (lp, tid, _) in enumerate(meta["output_token_logprobs"]):
        want = float(logp[len(prompt) - 1 + k, tid])
        assert math.isclose(lp, want, abs_tol=1e-3), (k, lp, want)  # k = 0 came through the aux row
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tid
    pd_cluster.wait_idle()


def test_stop_token_and_completions_endpoint(pd_cluster: Cluster) -> None:
    tok = _tokenizer(pd_cluster.model_dir)
    prompt_text = "the decode node streams"
    prompt = tok.encode(prompt_text)
    want, _ = hf_greedy(pd_cluster.model_dir, prompt, 10)
    stop_id = want[3]
    cut = want[: want.index(stop_id) + 1]  # the stop token is the last one generated
    body = {"model": None, "prompt": prompt_text, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [stop_id]}
    p, d = pd_cluster.pd("/v1/completions", body)
    assert p.status_code == 200 and d.status_code == 200, d.text
    out = d.json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["matched_stop"] == stop_id
    assert out["usage"]["completion_tokens"] == len(cut) and out["usage"]["prompt_tokens"] == len(prompt)
    assert out["choices"][0]["text"] == tok.decode(cut[:-1])  # the matched stop token is not shown
    p, events, status = pd_cluster.pd_stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == {"done": True}
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tok.decode(cut[:-1])
    assert events[-2]["usage"]["completion_tokens"] == len(cut)
    pd_cluster.wait_idle()


def test_stream_chunks_follow_the_stream_interval(pd_cluster: Cluster) -> None:
    """The llama pair's decode runs --stream-interval 3: after the first token (at once), no chunk
    but the last carries fewer than 3 new tokens; qwen3's (interval 1) first chunk is one token too."""
    interval = 3 if "llama" in pd_cluster.model_dir else 1
    prompt = list(range(5, 17))
    want, _ = hf_greedy(pd_cluster.model_dir, prompt, 11)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 11, "temperature": 0, "ignore_eos": True}}
    _, events, status = pd_cluster.pd_stream("/generate", body)
    assert status == 200 and events[-1] == {"done": True}
    ids = [e["output_ids"] for e in events[:-1]]  # native streams carry the cumulative ids
    assert ids[-1] == want, (ids, want)
    sizes = [len(b) - len(a) for a, b in zip([[]] + ids[:-1], ids)]
    assert sizes[0] == 1 and all(n >= interval for n in sizes[1:-1]), sizes
    pd_cluster.wait_idle()


def test_stop_string_is_held_back_and_cut(pd_cluster: Cluster) -> None:
    tok = _tokenizer(pd_cluster.model_dir)
    prompt = [21, 22, 23, 24, 25, 26]
    want, _ = hf_greedy(pd_cluster.model_dir, prompt, 12)
    full = tok.decode(want)
    # the first 2-character piece from the second character on that is plain text and occurs first there
    stop = next((full[i:i + 2] for i in range(1, len(full) - 2)
                 if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip() and full.index(full[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip(f"reference text {full!r} has no usable stop string")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                     "stop": [stop]}}
    p, events, status = pd_cluster.pd_stream("/generate", body)
    assert status == 200 and p.status_code == 200
    last = events[-2]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["text"] == full[: full.index(stop)]
    assert all(stop not in e["text"] for e in events[:-1])  # never shown, not even for one chunk
    pd_cluster.wait_idle()


def test_ops_endpoints_on_the_decode_node(pd_cluster: Cluster) -> None:
    import httpx

    d = pd_cluster.decode.url
    load = httpx.get(d + "/get_load", timeout=10).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    info = httpx.get(d + "/server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "decode"
    text = httpx.get(d + "/metrics", timeout=10).text
    assert "pdc_scheduler_num_running_reqs" in text and "pdc_scheduler_gen_throughput" in text
    # Every decode step ran as one call of the whole-step kernel where the kernels build (--cpu-linear
    # auto packs every projection for ours, the llama cluster's native too); none where they do not.
    counts = {name: float(value) for name, value in re.findall(
        r"^pdc_(scheduler_decode|decode_native)_steps_total(?:\{[^}]*\})? (\S+)$", text, flags=re.M)}
    steps = counts["scheduler_decode"]
    assert steps > 0, text
    assert counts["decode_native"] == (steps if kernels.decode_step() is not None else 0), counts
    assert httpx.post(d + "/flush_cache", timeout=10).status_code == 200
    assert httpx.get(d + "/health_generate", timeout=30).status_code == 200  # a local request, computed here
    mem = memory(d)
    assert mem["integrity"] == "ok" and mem["transfer_rooms"] == 0


def test_multiturn_conversations_reuse_the_decode_cache_and_match_hf(pd_cluster: Cluster) -> None:
    """Each turn's prompt = the previous prompt + its answer + new user tokens. Every output is HF
    greedy for its full prompt, and turn k >= 2 receives only the pages past the previous turn's
    cached whole pages (the llama pair: decode prefix cache on): per request by its answer's
    ``decode_reused_tokens``, and by the decode's metrics around it (tokens, bytes on the wire).
    Every third turn goes to the decode alone, as our router sends one with
    --decode-local-prefill-tokens: it computes the tokens past its cached prefix itself (real
    numerics on top of KV that arrived over the wire), nothing is transferred, and its answer says
    what it reused and computed. MULTITURN_CONVERSATIONS x MULTITURN_TURNS scale it (CI: 2 x 3;
    ``make multiturn-acceptance``: 32 x 6)."""
    import httpx

    from tests.e2e.cluster import metric

    reuse = "llama" in pd_cluster.model_dir
    if not reuse:  # the qwen3 pair runs without a decode cache; that path is covered in tests/unit (CI time)
        pytest.skip("the qwen3 pair's decode keeps no prefix cache")
    ps, d = 16, pd_cluster.decode.url
    nbytes = page_nbytes(pd_cluster.model_dir)
    convs = int(os.environ.get("MULTITURN_CONVERSATIONS", "2"))
    turns = int(os.environ.get("MULTITURN_TURNS", "3"))
    rng = random.Random(23)
    vocab = _tokenizer(pd_cluster.model_dir).vocab_size

    def counters() -> tuple[float, float, float, float]:
        return (metric(d, "pdc_decode_transferred_tokens_total"), metric(d, "pdc_decode_reused_tokens_total"),
                metric(d, "pdc_decode_transferred_bytes_total"), metric(d, "pdc_decode_local_prefill_tokens_total"))

    for c in range(convs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 41))]
        cached_upto = 0  # tokens whose KV the decode holds for this conversation (whole pages)
        prev_prompt: list[int] = []
        for t in range(turns):
            n, stream, local = rng.randrange(5, 10), (c + t) % 2 == 1, t % 3 == 2
            what = f"conversation {c} turn {t} prompt_len={len(prompt)} stream={stream} local={local}"
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            before = counters()
            if local:  # no bootstrap fields: the decode computes what its cache lacks
                if stream:
                    events = []
                    with httpx.stream("POST", d + "/generate", json={**body, "stream": True}, timeout=60) as r:
                        assert r.status_code == 200, (what, r.read())
                        events = [json.loads(line[6:]) for line in r.iter_lines()
                                  if line.startswith("data: ") and line != "data: [DONE]"]
                    got, meta = events[-1]["output_ids"], events[-1]["meta_info"]
                else:
                    r = httpx.post(d + "/generate", json=body, timeout=60)
                    assert r.status_code == 200, (what, r.text)
                    got, meta = r.json()["output_ids"], r.json()["meta_info"]
                check_greedy(pd_cluster.model_dir, prompt, got, n, what)
                after = counters()
                want_reused = min(cached_upto, (len(prompt) - 1) // ps * ps)
                assert (meta["decode_reused_tokens"], meta["decode_computed_tokens"]) == \
                    (want_reused, len(prompt) - want_reused), (what, meta)
                assert meta["cached_tokens"] == want_reused, (what, meta)  # the hit where it was computed
                assert (after[0] - before[0], after[2] - before[2]) == (0, 0), what  # nothing crossed the wire
                assert (after[1] - before[1], after[3] - before[3]) == (want_reused, len(prompt) - want_reused), what
                cached_upto = (len(prompt) + len(got) - 1) // ps * ps
                # prev_prompt stays: the prefill never saw this turn, its cache holds the one before.
                prompt = prompt + got + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 21))]
                continue
            if stream:
                p, events, status = pd_cluster.pd_stream("/generate", body)
                assert p.status_code == 200 and status == 200 and events[-1] == {"done": True}, what
                got, meta = events[-2]["output_ids"], events[-2]["meta_info"]
            else:
                p, r = pd_cluster.pd("/generate", body)
                assert p.status_code == 200 and r.status_code == 200, (what, r.text)
                got, meta = r.json()["output_ids"], r.json()["meta_info"]
            check_greedy(pd_cluster.model_dir, prompt, got, n, what)
            after = counters()
            # One decode: every turn lands on the decode holding its conversation. It reuses the
            # previous turn's whole pages (prompt + answer - 1 token), at least one token left to send.
            want_reused = min(cached_upto, (len(prompt) - 1) // ps * ps) if reuse else 0
            sent_pages = -(-len(prompt) // ps) - want_reused // ps
            # Per request, in the answer: the decode's reuse, and the rest of the prompt is what arrived.
            assert meta["decode_reused_tokens"] == want_reused and meta["prompt_tokens"] == len(prompt), (what, meta)
            transferred = meta["prompt_tokens"] - meta["decode_reused_tokens"]
            assert (after[0] - before[0], after[1] - before[1]) == (transferred, want_reused), what
            assert after[2] - before[2] == sent_pages * nbytes, what
            # The prefill's own cache hit stays what meta_info reports: the previous prompt's whole pages.
            assert meta["cached_tokens"] == min(len(prev_prompt) // ps * ps, (len(prompt) - 1) // ps * ps), (what, meta)
            # The decode wrote KV for prompt + got[:-1]: its whole pages are cached for the next turn.
            cached_upto = (len(prompt) + len(got) - 1) // ps * ps
            prev_prompt = prompt
            prompt = prompt + got + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 21))]
    pd_cluster.wait_idle()
    flushed = httpx.post(d + "/flush_cache", timeout=10).json()
    assert flushed["success"], flushed
    mem = memory(d)
    assert mem["cached_pages"] == 0 and mem["free_pages"] == mem["total_pages"], mem


def test_a_prompt_computed_before_the_decode_hears_of_it_matches_hf(pd_cluster: Cluster) -> None:
    """The prefill computes a prompt while its decode has not answered (the default
    --compute-ahead-fraction): the request is sent to the prefill alone first and waits there
    parked, its KV in the prefill's pages. Only then does the decode get its half; the KV goes out
    once the decode said where to write, over real Mooncake, and the answer equals HF greedy. On
    the llama pair the second turn is parked too and only the pages past the decode's own cached
    prefix cross the wire: the decode's reuse is known to the prefill only from its answer."""
    import httpx

    from tests.e2e.cluster import metric

    p_url, d_url, ps = pd_cluster.prefill.url, pd_cluster.decode.url, 16
    reuse = "llama" in pd_cluster.model_dir
    vocab = _tokenizer(pd_cluster.model_dir).vocab_size
    rng = random.Random(41)
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(40, 60))]
    cached_upto = 0
    for turn in range(2):
        n = 6
        what = f"turn {turn} prompt_len={len(prompt)}"
        body = pd_cluster.body({"input_ids": prompt,
                                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        sent_before = metric(d_url, "pdc_decode_transferred_tokens_total")
        with ThreadPoolExecutor(1) as ex:
            p = ex.submit(httpx.post, p_url + "/generate", json={**body, "stream": True}, timeout=60)
            deadline = time.monotonic() + 20
            while memory(p_url)["parked_reqs"] != 1:
                assert time.monotonic() < deadline and not p.done(), (what, memory(p_url))
                time.sleep(0.02)
            d = httpx.post(d_url + "/generate", json=body, timeout=60)
            assert d.status_code == 200 and p.result().status_code == 200, (what, d.text)
        got, meta = d.json()["output_ids"], d.json()["meta_info"]
        check_greedy(pd_cluster.model_dir, prompt, got, n, what)
        want_reused = min(cached_upto, (len(prompt) - 1) // ps * ps) if reuse else 0
        assert meta["decode_reused_tokens"] == want_reused, (what, meta)
        assert metric(d_url, "pdc_decode_transferred_tokens_total") - sent_before == len(prompt) - want_reused, what
        cached_upto = (len(prompt) + len(got) - 1) // ps * ps
        prompt = prompt + got + [rng.randrange(3, vocab) for _ in range(10)]
    if reuse:
        assert cached_upto > 0 and want_reused > 0, "the second turn reused the decode's cache"
    pd_cluster.wait_idle()
