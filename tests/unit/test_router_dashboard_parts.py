"""The live page's parts without a network: the router's recent TTFT/TPOT window, the token count
of a finished stream, reading a node's scheduler gauges, and the page shipping in the wheel."""
from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from common.server.metrics import ApiMetrics
from router.dashboard import PAGE, scheduler_gauges
from router.metrics import RecentLatency, stream_tokens

ROOT = Path(__file__).resolve().parents[2]


def test_recent_latency_keeps_the_window_per_worker_and_forgets_old_samples() -> None:
    r = RecentLatency(window_s=10.0)
    for i, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.5]):
        r.observe("http://a", "ttft", v, now=100.0 + i)
    r.observe("http://b", "ttft", 9.0, now=104.0)
    assert r.summary("http://a", "ttft", now=104.0) == {"n": 5, "p50": 0.3, "p90": pytest.approx(0.46)}
    assert r.summary("http://a", "ttft", now=112.5)["n"] == 2  # samples older than 10 s are gone
    assert r.summary("http://a", "ttft", now=200.0) == {"n": 0, "p50": None, "p90": None}
    assert r.summary("http://b", "ttft", now=104.0)["p50"] == 9.0
    assert r.summary("http://a", "tpot", now=104.0)["n"] == 0


def test_tpot_is_the_time_after_the_first_token_per_later_token() -> None:
    r = RecentLatency()
    r.stream_ended("http://d", first=10.0, last=10.9, tokens=10)  # 9 tokens after the first in 0.9 s
    r.stream_ended("http://d", first=10.0, last=10.5, tokens=1)  # one token: no TPOT
    r.stream_ended("http://d", first=10.0, last=10.0, tokens=5)  # all in one read: no TPOT
    s = r.summary("http://d", "tpot", now=11.0)
    assert s["n"] == 1 and s["p50"] == pytest.approx(0.1)


def _sse(*objs: object) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)


def test_stream_tokens_reads_the_last_frame_else_counts_frames() -> None:
    generate = _sse({"text": "ab", "meta_info": {"completion_tokens": 7}}) + b"data: [DONE]\n\n"
    assert stream_tokens(generate, frames=3, sequences=1) == 7  # frames may carry several tokens
    usage = _sse({"choices": [], "usage": {"completion_tokens": 12}})
    assert stream_tokens(usage, frames=20, sequences=2) == 6  # usage is over every sequence
    plain = _sse({"choices": [{"text": "x"}]})
    assert stream_tokens(plain, frames=8, sequences=2) == 4
    assert stream_tokens(b"data: {not json\n\n", frames=3, sequences=1) == 3


def test_scheduler_gauges_read_a_nodes_metrics_page() -> None:
    page = ApiMetrics("decode", "m").render({"gen_throughput": 42.5, "num_running_reqs": 3, "note": "skipped"})
    gauges = scheduler_gauges(page.decode())
    assert gauges == {"up": 1.0, "gen_throughput": 42.5, "num_running_reqs": 3.0}
    assert scheduler_gauges(ApiMetrics("decode", "m").render(None).decode()) == {"up": 0.0}


def test_the_page_ships_as_package_data() -> None:
    """A non-editable install (every image) has only what package-data names."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["router"]
    static = [p.relative_to(ROOT / "router").as_posix() for p in (ROOT / "router" / "static").iterdir()]
    assert PAGE in static
    assert all(any(fnmatch(p, g) for g in globs) for p in static), (static, globs)
