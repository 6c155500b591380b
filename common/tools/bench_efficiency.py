"""A ``pdcluster bench`` run's prefill efficiency: model FLOPs per second of prefill forward over
the measured matmul peak (``python -m common.tools.bench_limits --json``, ``--limits``) for the
threads the prefill node has.

FLOPs are ``roofline.prefill_flops`` of each completed request's prompt (the bench's prompts are
random token ids, so the prefix cache rarely saves any); the seconds are the run's delta of the
prefill nodes' ``forward_seconds_total`` counter, which covers forwards only (no queueing, no
transfer). Efficiency below 1 is time the forward spent off the matmul peak: attention, norms,
Python, or threads waiting on memory.
"""
from __future__ import annotations

from collections.abc import Sequence

from common.tools.bench_client import RequestResult
from common.tools.bench_limits import for_threads
from common.tools.roofline import Shape, prefill_flops


def prefill_efficiency(shape: Shape, results: Sequence[RequestResult], node_deltas: dict[str, dict[str, float]],
                       limits: dict, threads: int, bf16: bool = False) -> dict[str, float] | None:
    """``{flops, forward_s, gflops_per_s, peak_gflops, threads, efficiency}``, or None when the
    run has no prefill forward time (no prefill node among ``node_deltas``, or nothing ran).
    ``bf16``: the node multiplies in bfloat16 (a bf16 model or ``--cpu-linear bf16``), so the
    bf16 peak is the bar where the limits have one."""
    forward_s = sum(d.get("forward_seconds_total", 0.0) for name, d in node_deltas.items() if name.startswith("prefill"))
    if forward_s <= 0:
        return None
    flops = sum(prefill_flops(shape, r.input_len) for r in results if r.ok)
    row = for_threads(limits, threads)
    peak = row["bf16_gflops"] if bf16 and "bf16_gflops" in row else row["fp32_gflops"]
    rate = flops / forward_s / 1e9
    return {"flops": float(flops), "forward_s": round(forward_s, 4), "gflops_per_s": round(rate, 2),
            "peak_gflops": peak, "threads": float(row["threads"]),
            "efficiency": round(rate / peak, 4)}
