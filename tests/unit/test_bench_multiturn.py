"""``pdcluster bench --workload multiturn`` without a cluster: the draw, each turn's prompt built
from the previous prompt + its answer + the new user ids, a failed turn ending its conversation,
each conversation on its own clock, and the per-turn rows computed from the answers' own
reuse fields (common/tools/bench_multiturn.py)."""
from __future__ import annotations

import asyncio
import math
import time

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
        assert c.start_s == 0.0  # no rate: every conversation at once
    assert mt.longest_prompt(40, 10, 8, 4) == 40 + 3 * 18
    with pytest.raises(ValueError):
        mt.make_conversations(0, 1, 4, 4, 4, 1.0, 10, 0.0, seed=1)
    with pytest.raises(ValueError):
        mt.make_conversations(2, 1, 4, 4, 4, 1.0, 10, 0.0, seed=1, rate=0.0)


def test_conversations_arrive_as_a_poisson_process_at_the_rate() -> None:
    convs = mt.make_conversations(400, 1, 4, 4, 4, 1.0, 10, 0.0, seed=5, rate=4.0)
    starts = [c.start_s for c in convs]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.15)  # 1 / rate


def _answers(fail_prompt: list[int] | None = None, seen: list[list[int]] | None = None):  # type: ignore[no-untyped-def]
    """A fake ``send``: the answer depends on the prompt; the decode reports that it reused all but
    the last 3 prompt tokens and the prefill that it cached half; ``fail_prompt`` fails turn 2."""
    async def fake_send(session, target, req, t0, timeout_s, keep_output=False):  # type: ignore[no-untyped-def]
        if seen is not None:
            seen.append(list(req.input_ids))
        answer = [1000 + len(req.input_ids) + k for k in range(req.output_len)]
        fail = fail_prompt is not None and req.input_ids[:len(fail_prompt)] == fail_prompt \
            and len(req.input_ids) > len(fail_prompt)
        return RequestResult(req.index, req.input_len, req.output_len, ok=not fail, ttft_s=0.01,
                             output_tokens=req.output_len, output_ids=answer if keep_output else [],
                             cached_tokens=req.input_len // 2, decode_reused_tokens=req.input_len - 3)
    return fake_send


def test_each_turn_resends_the_conversation_and_a_failure_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    convs = mt.make_conversations(2, 3, 6, 3, 2, 1.0, 50, 0.0, seed=1)
    seen: list[list[int]] = []
    monkeypatch.setattr(mt, "send", _answers(fail_prompt=convs[1].first_prompt, seen=seen))
    # The decodes' counters before and after: 8 bytes per transferred token over the run.
    counters = iter([{"pdc_decode_transferred_tokens_total": 100.0, "pdc_decode_transferred_bytes_total": 800.0},
                     {"pdc_decode_transferred_tokens_total": 115.0, "pdc_decode_transferred_bytes_total": 920.0}])
    results, _, rows, summary = asyncio.run(mt.run_conversations(Target(url="http://x"), convs, lambda: next(counters),
                                                                 None, 5.0, 60.0))
    c0 = convs[0]
    p1 = c0.first_prompt
    p2 = p1 + [1000 + len(p1) + k for k in range(c0.output_lens[0])] + c0.user_turns[0]
    p3 = p2 + [1000 + len(p2) + k for k in range(c0.output_lens[1])] + c0.user_turns[1]
    assert [s for s in seen if s[:6] == p1] == [p1, p2, p3]
    assert len(results) == 5 and [r.index for r in results] == sorted(r.index for r in results)
    assert [(r["turn"], r["requests"], r["ok"]) for r in rows] == [(1, 2, 2), (2, 2, 1), (3, 1, 1)]
    # Turn 1: both conversations' first prompts (6 tokens each); 3 tokens each crossed the wire.
    assert rows[0]["transferred_tokens"] == 6 and rows[0]["reused_tokens"] == 6
    assert rows[0]["transferred_tokens_per_request"] == 3 and rows[0]["transferred_bytes_per_request"] == 24
    assert rows[0]["decode_hit_rate"] == pytest.approx(0.5) and rows[0]["prefill_hit_rate"] == pytest.approx(0.5)
    # Turn 2: only the answer that succeeded counts.
    assert rows[1]["transferred_tokens"] == 3 and rows[1]["reused_tokens"] == len(p2) - 3
    assert summary["transferred_tokens_per_request_sum"] == 6 + 3 + 3
    assert summary["transferred_tokens_nodes"] == 15 and summary["transferred_bytes_nodes"] == 120
    assert summary["later_turns_ttft_p50_ms"] == pytest.approx(10.0)
    assert sorted(summary["request_turns"]) == [1, 1, 2, 2, 3]
    text = mt.format_turns(rows, summary)
    assert "| 2 | 1/2 |" in text and "12 by the answers, 15 by the nodes' counters" in text


def test_a_server_that_reports_no_reuse_leaves_the_columns_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    async def plain(session, target, req, t0, timeout_s, keep_output=False):  # type: ignore[no-untyped-def]
        return RequestResult(req.index, req.input_len, req.output_len, ok=True, ttft_s=0.02,
                             output_tokens=req.output_len, output_ids=[1] * req.output_len)

    monkeypatch.setattr(mt, "send", plain)
    convs = mt.make_conversations(2, 2, 6, 3, 2, 1.0, 50, 0.0, seed=2)
    _, _, rows, summary = asyncio.run(mt.run_conversations(Target(url="http://x"), convs, lambda: {}, None, 5.0, 60.0))
    assert all(r["transferred_tokens"] is None and r["decode_hit_rate"] is None and r["prefill_hit_rate"] is None
               and r["transferred_bytes_per_request"] is None for r in rows)
    assert summary["transferred_tokens_per_request_sum"] is None and "| 2 | 2/2 |" in mt.format_turns(rows, summary)


def test_each_conversation_keeps_its_own_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow thinker does not hold back the others' next turns, and a late arrival starts late."""
    sent_at: list[tuple[int, float]] = []  # (first prompt id, seconds from the start)
    t_start = time.perf_counter()
    inner = _answers()

    async def timed(session, target, req, t0, timeout_s, keep_output=False):  # type: ignore[no-untyped-def]
        sent_at.append((req.input_ids[0], time.perf_counter() - t_start))
        return await inner(session, target, req, t0, timeout_s, keep_output)

    monkeypatch.setattr(mt, "send", timed)
    fast = mt.Conversation(0, 0.0, [1, 1], [[5], [5]], [1, 1, 1], [0.0, 0.0])
    slow = mt.Conversation(1, 0.0, [2, 2], [[5], [5]], [1, 1, 1], [0.6, 0.6])
    late = mt.Conversation(2, 0.3, [3, 3], [], [1], [])
    results, _, rows, _ = asyncio.run(mt.run_conversations(Target(url="http://x"), [fast, slow, late], lambda: {},
                                                           None, 5.0, 60.0))
    assert len(results) == 7 and all(r.ok for r in results)
    fast_sends = [t for who, t in sent_at if who == 1]
    slow_sends = [t for who, t in sent_at if who == 2]
    assert len(fast_sends) == 3 and fast_sends[-1] < 0.25  # all of its turns before the slow one's second
    assert slow_sends[1] >= 0.55 and slow_sends[2] >= 1.15
    assert [t for who, t in sent_at if who == 3][0] >= 0.28


def test_the_run_deadline_leaves_a_clear_result_for_the_turn_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    async def hang(session, target, req, t0, timeout_s, keep_output=False):  # type: ignore[no-untyped-def]
        await asyncio.sleep(math.inf if req.input_ids[0] == 9 else 0)
        return RequestResult(req.index, req.input_len, req.output_len, ok=True, ttft_s=0.01,
                             output_tokens=req.output_len, output_ids=[4] * req.output_len)

    monkeypatch.setattr(mt, "send", hang)
    ok = mt.Conversation(0, 0.0, [1], [[5]], [1, 1], [0.0])
    stuck = mt.Conversation(1, 0.0, [9], [[5]], [1, 1], [0.0])
    results, duration, rows, _ = asyncio.run(mt.run_conversations(Target(url="http://x"), [ok, stuck], lambda: {},
                                                                  None, 5.0, 0.3))
    assert duration < 2.0 and len(results) == 3
    bad = [r for r in results if not r.ok]
    assert len(bad) == 1 and "--timeout" in (bad[0].error or "")
    assert [(r["turn"], r["requests"], r["ok"]) for r in rows] == [(1, 2, 1), (2, 1, 1)]


def test_node_counters_are_summed_over_the_decodes() -> None:
    decode = ("pdc_decode_transferred_bytes_total{role=\"decode\"} 320.0\npdc_decode_transferred_tokens_total 7.0\n"
              "pdc_scheduler_cached_tokens_total 999.0\n")
    pages = {"http://d0/metrics": decode, "http://d1/metrics": decode, "http://p0/metrics": decode}

    def get_text(url: str) -> str:
        if url not in pages:
            raise OSError("down")
        return pages[url]

    got = mt.read_nodes({"decode0": "http://d0", "decode1": "http://d1", "decode2": "http://gone",
                         "prefill0": "http://p0"}, get_text)
    assert got == {"pdc_decode_transferred_bytes_total": 640.0, "pdc_decode_transferred_tokens_total": 14.0}
    assert mt.transferred({}, got) == (14.0, 640.0) and mt.transferred(got, got) == (0.0, 0.0)
