"""Stage timelines as plain data: a scheduler's laps, a node's API hops around them, and the
router's composition and rewriting of whole answers and SSE frames."""
from __future__ import annotations

import json

from common.timeline import StageClock, node_timeline
from router.timeline import Marks, compose, rewrite_body, rewrite_frames


def test_laps_add_up_to_the_schedulers_span_and_recurring_stages_accumulate() -> None:
    c = StageClock("prefill", now=100.0)
    c.lap("bootstrap", 100.5)
    c.lap("queue", 100.6)
    c.lap("forward", 101.0)
    c.lap("queue", 101.5)  # waited for its next chunk's turn
    c.lap("forward", 102.0)
    c.lap("transfer", 102.25)
    t = c.times()
    assert list(t.stages) == ["bootstrap", "queue", "forward", "transfer"]
    assert abs(t.stages["queue"] - 0.6) < 1e-9 and abs(t.stages["forward"] - 0.9) < 1e-9
    assert abs(sum(t.stages.values()) - 2.25) < 1e-9


def test_node_timeline_puts_the_api_hops_around_the_scheduler() -> None:
    c = StageClock("decode", now=10.002)
    c.lap("prealloc", 10.003)
    c.lap("decode", 10.010)
    tl = node_timeline(c.times(), arrival=10.0, now=10.012)
    assert tl["role"] == "decode" and tl["total_ms"] == 12.0
    assert tl["stages_ms"] == {"api_in": 2.0, "prealloc": 1.0, "decode": 7.0, "api_out": 2.0}


def _node(role: str, total: float, **stages: float) -> dict:
    return {"role": role, "total_ms": total, "stages_ms": stages, "forwards": 1}


def test_compose_fits_the_decode_inside_the_routers_span() -> None:
    marks = Marks(arrival=0.0, sent=0.001)
    out = compose(marks, final_in=0.011, decode=_node("decode", 8.0, api_in=1.0, decode=7.0), prefill=None)
    st = out["stages_ms"]
    assert st["router_pick"] == 1.0 and st["decode_hop"] == 2.0  # 10 ms seen by the router, 8 by the decode
    assert st["decode.api_in"] == 1.0 and st["decode.decode"] == 7.0
    assert abs(sum(st.values()) - out["e2e_ms"]) < 0.01 and "prefill" not in out


def test_whole_answers_are_rewritten_per_sequence_and_others_pass_byte_for_byte() -> None:
    marks = Marks(arrival=0.0, sent=0.0)
    seen: list[dict] = []
    batch = [{"index": i, "meta_info": {"timeline": _node("decode", 1.0, decode=1.0)}} for i in range(2)]
    prefill = [{"index": i, "meta_info": {"timeline": _node("prefill", float(i + 5), forward=1.0)}} for i in range(2)]
    out = json.loads(rewrite_body(json.dumps(batch).encode(), marks, 0.002, prefill, seen.append))
    assert [o["meta_info"]["timeline"]["prefill"]["total_ms"] for o in out] == [5.0, 6.0]
    assert len(seen) == 2 and all("e2e_ms" in o["meta_info"]["timeline"] for o in out)
    for raw in (b'{"text": "no timeline"}', b'not json "timeline"'):
        assert rewrite_body(raw, marks, 0.0, None, seen.append) == raw
    chat = {"choices": [{"index": 0, "timeline": _node("decode", 1.0, decode=1.0)}]}
    out = json.loads(rewrite_body(json.dumps(chat).encode(), marks, 0.001, None, seen.append))
    assert out["choices"][0]["timeline"]["decode"]["role"] == "decode"


def test_only_the_sse_event_with_a_timeline_is_rewritten() -> None:
    first = b'data: {"text": "a", "meta_info": {}}'
    last = b"data: " + json.dumps({"text": "ab", "meta_info": {"timeline": _node("decode", 1.0, decode=1.0)}}).encode()
    frames = first + b"\n\n" + last + b"\n\ndata: [DONE]\n\n"
    out = rewrite_frames(frames, Marks(arrival=0.0, sent=0.0), None, lambda _: None)
    events = out.split(b"\n\n")
    assert events[0] == first and events[2:] == [b"data: [DONE]", b""]
    assert "e2e_ms" in json.loads(events[1][6:])["meta_info"]["timeline"]
    assert rewrite_frames(first + b"\n\n", Marks(0.0), None, lambda _: None) == first + b"\n\n"
