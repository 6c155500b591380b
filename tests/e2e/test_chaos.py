"""CI-sized chaos and soak runs (``make chaos`` / ``make soak`` are the full ones; figures in
docs/RELIABILITY.md). tests/chaos/driver.py and soak.py say what is injected and checked."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.chaos.driver import REQUEST_BOUND_S, run_chaos
from tests.chaos.soak import run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_chaos_storm_leaves_no_leak_no_wrong_token_and_no_wedge(tiny_model_factory: Callable[..., str],
                                                                 tmp_path: object) -> None:
    report = run_chaos(tiny_model_factory("qwen3"), str(tmp_path), n=150, concurrency=8, seed=1)
    print(report.table())
    assert len(report.node_faults) == 3, report.node_faults
    assert report.outcomes["completed"] > 75, report.table()  # the storm did serve
    assert report.openai_completed > 10, report.table()  # over both APIs
    assert sum(c["client_gone"] for c in report.by_fault.values()) > 0  # and the faults did fire
    assert not report.wrong_tokens and not report.unclear, report.table()
    assert not report.not_idle and not report.wedged, report.table()
    assert report.max_elapsed_s <= REQUEST_BOUND_S + 5.0, report.table()


def test_soak_rss_is_flat_after_warm_up(tiny_model_factory: Callable[..., str], tmp_path: object) -> None:
    report = run_soak(tiny_model_factory("qwen3"), str(tmp_path), seconds=60, concurrency=16)
    print(report.table())
    assert report.requests["ok"] > 100, report.table()
    assert {name.split("/")[0] for name in report.rss} >= {"router", "prefill0", "decode0"}, report.rss.keys()
    assert report.clean, report.table()
