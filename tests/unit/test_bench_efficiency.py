"""The prefill efficiency of a bench run, from counter deltas and the measured peak."""
from __future__ import annotations

import pytest

from common.tools.bench_client import RequestResult
from common.tools.bench_efficiency import prefill_efficiency
from common.tools.roofline import Shape

TOY = Shape(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
LIMITS = {"rows": [{"threads": 1, "read_gbs": 10.0, "fp32_gflops": 2.0}, {"threads": 2, "read_gbs": 18.0,
                                                                          "fp32_gflops": 4.0}]}


def _res(n: int, ok: bool = True) -> RequestResult:
    r = RequestResult(index=0, input_len=n, output_len=1)
    r.ok = ok
    return r


def test_efficiency_from_flops_forward_seconds_and_peak() -> None:
    # prefill_flops(TOY, 3) = 1040 by hand (test_roofline); two ok prompts, one failed (not counted)
    deltas = {"prefill0": {"forward_seconds_total": 1e-6}, "decode0": {"forward_seconds_total": 5.0}}
    eff = prefill_efficiency(TOY, [_res(3), _res(3), _res(3, ok=False)], deltas, LIMITS, threads=2)
    assert eff is not None
    assert eff["flops"] == 2080 and eff["threads"] == 2 and eff["peak_gflops"] == 4.0
    assert eff["gflops_per_s"] == pytest.approx(2.08)
    assert eff["efficiency"] == pytest.approx(0.52)


def test_no_prefill_forward_time_gives_none() -> None:
    assert prefill_efficiency(TOY, [_res(3)], {"decode0": {"forward_seconds_total": 1.0}}, LIMITS, 1) is None


def test_a_bfloat16_node_is_held_to_the_bf16_peak_where_measured() -> None:
    deltas = {"prefill0": {"forward_seconds_total": 1e-6}}
    with_bf16 = {"rows": [{"threads": 1, "read_gbs": 10.0, "fp32_gflops": 2.0, "bf16_gflops": 8.0}]}
    eff = prefill_efficiency(TOY, [_res(3)], deltas, with_bf16, 1, bf16=True)
    assert eff is not None and eff["peak_gflops"] == 8.0 and eff["efficiency"] == pytest.approx(1.04 / 8)
    assert prefill_efficiency(TOY, [_res(3)], deltas, with_bf16, 1)["peak_gflops"] == 2.0  # type: ignore[index]
    assert prefill_efficiency(TOY, [_res(3)], deltas, LIMITS, 1, bf16=True)["peak_gflops"] == 2.0  # type: ignore[index]
