"""Numbers of a ``pdcluster bench`` run: throughput, latency percentiles, goodput, leak check.

Pure functions of the per-request results and of the nodes' ``/debug/memory`` and ``/metrics``
answers, so they can be tested without a cluster. Definitions follow SGLang's bench_serving:

    duration        first send to last answer (seconds)
    req/s, tok/s    completed requests, their prompt and generated tokens, divided by duration
    TTFT/E2E/TPOT   one sample per completed request (TPOT only with >= 2 output tokens)
    ITL             one sample per generated token after the first, over all completed requests
    goodput         completed requests meeting every SLO given, per second of duration
    concurrency     sum of E2E / duration: the mean number of requests in flight
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from common.tools.bench_client import RequestResult

PERCENTILES = (50, 90, 99)

# /debug/memory keys that may differ between two idle moments: the prefill's prefix cache keeps
# pages after a run (free + evictable still equals total), and the decode's new-token ratio moves.
_MAY_CHANGE = {"free_pages", "cached_pages", "evictable_pages", "new_token_ratio"}
# Counts of things only a live request holds: all 0 on an idle node (either role's names).
_LIVE = ("locked_pages", "used_pages", "held_pages", "transfer_pages", "transfer_rooms", "bootstrap_reqs",
         "waiting_reqs", "chunked_reqs", "parked_reqs", "inflight_reqs", "live_reqs", "num_prealloc", "num_transfer",
         "num_waiting", "num_running", "num_retracted", "num_draining")
_IDLE_CHECKED = {*_LIVE, "free_req_slots", "aux_free_slots", "integrity"}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean, p50/p90/p99 and max in milliseconds; None without samples."""
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": sum(ms) / len(ms)}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    out["max"] = max(ms)
    return {k: round(v, 3) for k, v in out.items()}


def summarize(results: Sequence[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    dur = max(duration_s, 1e-9)
    in_tok = sum(r.input_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    good = [r for r in ok if _meets(r, slo_ttft_ms, slo_tpot_ms)]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "failure_reasons": dict(Counter(reason_class(r.error or "unknown") for r in failed).most_common()),
        "duration_s": round(duration_s, 6),  # a fake-backend run can take 40 ms: keep µs
        "request_throughput": round(len(ok) / dur, 4),
        "input_throughput": round(in_tok / dur, 2),
        "output_throughput": round(out_tok / dur, 2),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "requested_output_tokens": sum(r.output_len for r in results),
        "concurrency": round(sum(r.e2e_s or 0.0 for r in ok) / dur, 3),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "tpot_ms": distribution_ms(tpots),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prefill_answer_ms": distribution_ms([r.prefill_s for r in ok if r.prefill_s is not None]),
        "stages_ms": stage_breakdown([r.stages_ms for r in ok]),
        # The prefill's, nested by the router: they ran inside the decode's prealloc + kv_transfer.
        "prefill_stages_ms": stage_breakdown([r.prefill_stages_ms for r in ok]),
        "goodput": {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "good_requests": len(good),
                    "request_goodput": round(len(good) / dur, 4)},
    }


def stage_breakdown(per_req: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """mean/p50/p90/p99/max of each timeline stage over the requests that report one (one
    stage -> ms dict per request), in the stages' own order (empty when none has a timeline)."""
    names: dict[str, None] = {}
    for st in per_req:
        names.update(dict.fromkeys(st))
    out = {}
    for name in names:
        d = distribution_ms([st[name] / 1000.0 for st in per_req if name in st])
        if d is not None:
            out[name] = d
    return out


def _meets(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000.0 > slo_ttft_ms):
        return False
    tpot = r.tpot_s
    # A one-token answer has no TPOT, so it cannot miss a TPOT SLO.
    return slo_tpot_ms is None or tpot is None or tpot * 1000.0 <= slo_tpot_ms


def reason_class(reason: str) -> str:
    """Failure reasons grouped for counting: room ids, rids and numbers of 5+ digits elided."""
    reason = re.sub(r"\b[0-9a-f]{32}\b", "<rid>", reason)
    return re.sub(r"\d{5,}", "<n>", reason)[:200]


def idle_problems(mem: dict) -> list[str]:
    """What in one node's ``/debug/memory`` says it still holds something (empty: idle)."""
    out = []
    if "total_pages" in mem and mem.get("free_pages", 0) + mem.get("evictable_pages", 0) != mem["total_pages"]:
        out.append(f"free {mem.get('free_pages')} + evictable {mem.get('evictable_pages', 0)} pages != total "
                   f"{mem['total_pages']}")
    pairs = (("free_req_slots", "total_req_slots"), ("aux_free_slots", "aux_total_slots"))
    out += [f"{free} {mem[free]} != {total} {mem[total]}" for free, total in pairs
            if free in mem and total in mem and mem[free] != mem[total]]
    out += [f"{k} = {mem[k]}" for k in _LIVE if isinstance(mem.get(k), int) and mem[k] != 0]
    if mem.get("integrity", "ok") != "ok":
        out.append(f"integrity: {mem['integrity']}")
    return out


def memory_diff(before: dict, after: dict) -> dict[str, tuple[object, object]]:
    """Keys whose value changed between two reports (a key present on one side only counts)."""
    return {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k)}


def leak_check(before: dict, after: dict) -> list[str]:
    """Problems of a node after the run: not idle, or a count differing from before the run other
    than the prefix cache's (which may keep pages; they stay evictable)."""
    changed = [f"{k}: {b} -> {a}" for k, (b, a) in memory_diff(before, after).items()
               if k not in _MAY_CHANGE and k not in _IDLE_CHECKED]
    return idle_problems(after) + changed


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scheduler_counters(metrics_text: str) -> dict[str, float]:
    """``pdc_scheduler_*_total`` samples of a ``/metrics`` answer, by name without the prefix."""
    out = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(1).startswith("pdc_scheduler_") and m.group(1).endswith("_total"):
            try:
                out[m.group(1)[len("pdc_scheduler_"):]] = float(m.group(3))
            except ValueError:
                continue
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the run added to each scheduler counter (counters missing before count from 0)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


def decode_step_split(deltas: dict[str, float]) -> dict[str, float] | None:
    """Where a decode step's time went, from the decode node's counter deltas over the run:
    ``forward`` (model forward + sampling) and ``overhead`` (the rest of the scheduler loop's turn:
    queues, stop checks, output IPC) per step, and the mean batch. None without decode steps."""
    steps = deltas.get("decode_steps_total", 0.0)
    if steps <= 0:
        return None
    forward_ms = 1000.0 * deltas.get("decode_forward_seconds_total", 0.0) / steps
    out = {"steps": steps, "mean_batch": round(deltas.get("decode_batch_reqs_total", 0.0) / steps, 2),
           "forward_ms_per_step": round(forward_ms, 3)}
    if "decode_step_seconds_total" in deltas:  # absent on nodes older than the counter
        step_ms = 1000.0 * deltas["decode_step_seconds_total"] / steps
        out.update(step_ms_per_step=round(step_ms, 3), overhead_ms_per_step=round(step_ms - forward_ms, 3))
    return out


def format_step_split(split: dict[str, float]) -> str:
    line = (f"  decode step split: {split['steps']:g} steps, mean batch {split['mean_batch']:.1f}; "
            f"forward {split['forward_ms_per_step']:.2f} ms/step")
    if "overhead_ms_per_step" in split:
        line += (f", overhead {split['overhead_ms_per_step']:.2f} ms/step "
                 f"(step {split['step_ms_per_step']:.2f} ms)")
    return line


def format_report(summary: dict) -> str:
    """The human-readable block printed at the end of a run."""
    s = summary
    lines = [
        "============ pdcluster bench ============",
        f"{'completed / requests':<32}{s['completed']} / {s['num_requests']}",
        f"{'failed':<32}{s['failed']}",
    ]
    lines += [f"  {n:>4} x {reason}" for reason, n in s["failure_reasons"].items()]
    lines += [
        f"{'duration (s)':<32}{s['duration_s']:.2f}",
        f"{'request throughput (req/s)':<32}{s['request_throughput']:.2f}",
        f"{'input throughput (tok/s)':<32}{s['input_throughput']:.1f}",
        f"{'output throughput (tok/s)':<32}{s['output_throughput']:.1f}",
        f"{'input / output tokens':<32}{s['total_input_tokens']} / {s['total_output_tokens']}"
        f" (requested output {s['requested_output_tokens']})",
        f"{'mean concurrency':<32}{s['concurrency']:.2f}",
    ]
    g = s["goodput"]
    if g["slo_ttft_ms"] is not None or g["slo_tpot_ms"] is not None:
        lines.append(f"{'goodput (req/s)':<32}{g['request_goodput']:.2f}  ({g['good_requests']} requests meet "
                     f"TTFT <= {g['slo_ttft_ms']} ms, TPOT <= {g['slo_tpot_ms']} ms)")
    lines.append(f"{'(ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"),
                       ("prefill_answer_ms", "prefill answer")):
        d = s[key]
        if d is not None:
            lines.append(f"{label:<20}" + "".join(f"{d[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99", "max")))
    if s.get("stages_ms"):
        lines.append("stage timeline (ms, per request)")
        for name, d in s["stages_ms"].items():
            lines.append(f"  {name:<18}" + "".join(f"{d[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99", "max")))
    if s.get("prefill_stages_ms"):
        lines.append("  the prefill's, within the decode's prealloc + kv_transfer")
        for name, d in s["prefill_stages_ms"].items():
            lines.append(f"  prefill.{name:<10}" + "".join(f"{d[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99", "max")))
    return "\n".join(lines)
