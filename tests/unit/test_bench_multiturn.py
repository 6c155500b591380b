"""``pdcluster bench --workload multiturn`` without a cluster: the draw, each turn's prompt built
from the previous prompt + its answer + the new user ids, a failed turn ending its conversation,
and the per-turn row computed from node counters (common/tools/bench_multiturn.py)."""
from __future__ import annotations

import asyncio

import pytest

from common.tools import bench_multiturn as mt
from common.tools.bench_client import RequestResult, Target


def test_the_draw_is_deterministic_and_within_bounds() -> None:
    a = mt.make_conversations(5, 4, 40, 10, 8, 0.5, 100, 0.5, seed=3)
    assert a == mt.make_conversations(5, 4, 40, 10, 8, 0.5, 100, 0.5, seed=3)
    assert a != mt.make_conversations(5, 4, 40, 10, 8, 0.5, 100, 0.5, seed=4)
    for c in a:
        assert 20 <= len(c.first_prompt) <= 40 and len(c.user_turns) == 3 and len(c.output_lens) == 4
        assert all(5 <= len(u) <= 10 for u in c.user_turns) and all(4 <= n <= 8 for n in c.output_lens)
        assert len(c.think_s) == 3 and all(t >= 0 for t in c.think_s)
    assert mt.longest_prompt(40, 10, 8, 4) == 40 + 3 * 18
    with pytest.raises(ValueError):
        mt.make_conversations(0, 1, 4, 4, 4, 1.0, 10, 0.0, seed=1)


def test_each_turn_resends_the_conversation_and_a_failure_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    convs = mt.make_conversations(2, 3, 6, 3, 2, 1.0, 50, 0.0, seed=1)
    seen: list[list[int]] = []

    async def fake_send(session, target, req, t0, timeout_s, keep_output=False):  # type: ignore[no-untyped-def]
        seen.append(list(req.input_ids))
        answer = [1000 + len(req.input_ids) + k for k in range(req.output_len)]  # depends on the prompt
        fail = req.input_ids[:6] == convs[1].first_prompt and len(seen) > 2  # conversation 1 fails turn 2
        return RequestResult(req.index, req.input_len, req.output_len, ok=not fail, ttft_s=0.01,
                             output_tokens=req.output_len, output_ids=answer if keep_output else [])

    monkeypatch.setattr(mt, "send", fake_send)
    counters = iter([{"pdc_decode_transferred_tokens_total": 10.0 * i, "pdc_decode_reused_tokens_total": 5.0 * i,
                      "pdc_decode_transferred_bytes_total": 100.0 * i} for i in range(10)])
    results, _, rows = asyncio.run(mt.run_conversations(Target(url="http://x"), convs, lambda: next(counters), None, 5.0, 60.0))
    c0 = convs[0]
    p1 = c0.first_prompt
    p2 = p1 + [1000 + len(p1) + k for k in range(c0.output_lens[0])] + c0.user_turns[0]
    p3 = p2 + [1000 + len(p2) + k for k in range(c0.output_lens[1])] + c0.user_turns[1]
    assert [s for s in seen if s[:6] == p1] == [p1, p2, p3]
    assert len(results) == 5  # conversation 1 sent turns 1 and 2 only
    assert [(r["turn"], r["requests"], r["ok"]) for r in rows] == [(1, 2, 2), (2, 2, 1), (3, 1, 1)]
    assert rows[0]["transferred_tokens"] == 10 and rows[0]["decode_hit_rate"] == pytest.approx(5 / 15, abs=1e-4)
    assert rows[0]["transferred_bytes_per_request"] == 50 and rows[0]["prefill_hit_rate"] is None
    assert "| 2 | 1/2 |" in mt.format_turns(rows)


def test_node_counters_are_summed_by_role() -> None:
    decode = ("pdc_decode_reused_tokens_total{role=\"decode\"} 32.0\npdc_decode_transferred_tokens_total 7.0\n"
              "pdc_scheduler_cached_tokens_total 999.0\n")
    prefill = "pdc_scheduler_cached_tokens_total{x=\"y\"} 16.0\npdc_scheduler_prompt_tokens_total 48.0\n"
    pages = {"http://d0/metrics": decode, "http://d1/metrics": decode, "http://p0/metrics": prefill}

    def get_text(url: str) -> str:
        if url not in pages:
            raise OSError("down")
        return pages[url]

    got = mt.read_nodes({"decode0": "http://d0", "decode1": "http://d1", "prefill0": "http://p0", "prefill1": "http://gone"},
                        get_text)
    assert got == {"pdc_decode_reused_tokens_total": 64.0, "pdc_decode_transferred_tokens_total": 14.0,
                   "pdc_scheduler_cached_tokens_total": 16.0, "pdc_scheduler_prompt_tokens_total": 48.0}
