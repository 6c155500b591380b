"""Structured outputs on a bare 1P1D pair (the session's ``qwen3_pair``, Mooncake over TCP): each
request goes to the prefill and the decode node at once with one bootstrap room, as a router
would send it, with no router in between. The acceptance run of tests/e2e/grammar_schemas.py
(GRAMMAR_REQUESTS, 20 by default: one per schema, the four stream/greedy modes mixed) validates
and equals HF generate with the grammar as a logits processor; both nodes end idle.
"""
from __future__ import annotations

import time

import httpx
import pytest

from common.tokenizer import Tokenizer
from tests.e2e import grammar_schemas as grammar
from tests.e2e.cluster import NEAR_TIE, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PATH = "/v1/chat/completions"


def send(pair: Cluster, model: str, job: grammar.Job) -> tuple[str, str | None]:
    body = job.body(model)
    if job.stream:
        p, events, status = pair.pd_stream(PATH, body)
        assert status == 200 and p.status_code == 200, (job, status, events[-1:], p.text)
        return grammar.sse_chat(events)
    p, d = pair.pd(PATH, body)
    assert d.status_code == 200 and p.status_code == 200, (job, d.text, p.text)
    choice = d.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_structured_outputs_on_a_1p1d_pair_validate_and_match_hf(qwen3_pair: Cluster) -> None:
    model = httpx.get(qwen3_pair.decode.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    jobs = grammar.plan(grammar.requests_from_env(20))
    t0 = time.monotonic()
    results = grammar.run(jobs, lambda j: send(qwen3_pair, model, j))
    print(f"1P1D: {len(jobs)} structured requests in {time.monotonic() - t0:.1f} s")
    grammar.check(jobs, results, qwen3_pair.model_dir, Tokenizer(qwen3_pair.model_dir), NEAR_TIE)
    qwen3_pair.wait_idle()
