"""ApiMetrics: what the API counts per output and per request, rendered as Prometheus text."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.server import metrics as metrics_mod
from common.server.metrics import ApiMetrics


def samples(api: ApiMetrics) -> dict[tuple[str, tuple], float]:
    text = api.render(None).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "model_name")))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_counts_tokens_requests_sequences_and_stages() -> None:
    api = ApiMetrics("decode", "m")
    api.on_inflight(2)
    api.on_first_token(0.02)
    for n in (1, 1, 3, 0):
        api.on_tokens(n)
    api.on_inflight(-1)
    api.on_request("completions", 200)
    api.on_request("completions", 200)
    api.on_request("generate", 400)
    api.on_sequence(128, 16, {"decode.prealloc": 2.0, "decode.decode": 40.0})
    api.on_sequence(64, 0, {"decode.decode": 10.0})
    api.on_e2e(0.5)
    got = samples(api)
    assert got[("pdc_api_generation_tokens_total", ())] == 5
    assert got[("pdc_api_inflight_sequences", ())] == 1
    assert got[("pdc_api_requests_total", (("endpoint", "completions"), ("status", "200")))] == 2
    assert got[("pdc_api_requests_total", (("endpoint", "generate"), ("status", "400")))] == 1
    assert got[("pdc_api_prompt_tokens_total", ())] == 192
    assert got[("pdc_api_cached_tokens_total", ())] == 16
    assert got[("pdc_api_stage_seconds_count", (("stage", "decode.decode"),))] == 2
    assert got[("pdc_api_stage_seconds_sum", (("stage", "decode.decode"),))] == pytest.approx(0.05)
    assert got[("pdc_api_stage_seconds_count", (("stage", "decode.prealloc"),))] == 1
    assert got[("pdc_api_time_to_first_token_seconds_count", ())] == 1
    assert got[("pdc_api_e2e_request_latency_seconds_count", ())] == 1


def test_throughput_covers_the_last_window_seconds_only(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.2]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    api = ApiMetrics("decode", "m", window_s=10.0)
    api.on_tokens(30)
    now[0] = 1000.9
    api.on_tokens(20)  # the same second: one entry
    assert len(api._recent) == 1
    now[0] = 1005.5
    api.on_tokens(50)
    assert samples(api)[("pdc_api_generation_tokens_per_second", ())] == 10.0  # 100 tokens / 10 s
    now[0] = 1010.1  # second 1000 has left the window (seconds 1001..1010 count)
    assert samples(api)[("pdc_api_generation_tokens_per_second", ())] == 5.0
    now[0] = 1016.0
    assert samples(api)[("pdc_api_generation_tokens_per_second", ())] == 0.0
    assert not api._recent
