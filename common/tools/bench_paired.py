"""``pdcluster bench --launch --paired-direct``: what a router adds to a request's latency.

Comparing a run through the router with a later run without one mixes the router's cost with
the drift of a shared machine between the runs (on a 2-core box that drift is larger than the
router's cost). So this sends every request twice on one launched cluster, one at a time: once
through the router and once straight to its prefill + decode pair (the bench posting to both,
as a router would), in a random order per pair. The added latency is the distribution of the
per-pair differences, E2E and TTFT.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import sys
import tempfile
import time

import aiohttp

from common.tools import bench_report as report
from common.tools.bench_client import RequestResult, Target, send
from common.tools.bench_run import exit_on_sigterm
from common.tools.bench_workload import BenchRequest, make_workload
from common.tools.local_cluster import LocalCluster


async def _pairs(router: Target, direct: Target, reqs: list[BenchRequest], seed: int,
                 timeout_s: float) -> list[tuple[RequestResult, RequestResult]]:
    order = random.Random(seed)
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        t0 = time.perf_counter()
        for req in reqs:
            first_router = order.random() < 0.5
            results = {}
            for which in ((router, direct) if first_router else (direct, router)):
                results[which is router] = await send(session, which, req, t0, timeout_s)
            out.append((results[True], results[False]))
    return out


def _diffs_ms(pairs: list[tuple[RequestResult, RequestResult]], field: str) -> dict[str, float] | None:
    values = [getattr(r, field) - getattr(d, field) for r, d in pairs
              if r.ok and d.ok and getattr(r, field) is not None and getattr(d, field) is not None]
    if not values:
        return None
    return {"p10": round(report.percentile(values, 10) * 1e3, 3), "p50": round(report.percentile(values, 50) * 1e3, 3),
            "p90": round(report.percentile(values, 90) * 1e3, 3), "mean": round(sum(values) / len(values) * 1e3, 3)}


def paired(a: argparse.Namespace, model: str, vocab_size: int) -> tuple[int, dict]:
    cluster = LocalCluster(logdir=tempfile.mkdtemp(prefix="pdc-bench-paired-"))
    # A SIGTERM unwinds through the finally that stops the cluster.
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        try:
            url = cluster.start(model, backend=a.transfer_backend, page_size=a.page_size, router=a.router,
                                prefill_args=shlex.split(a.prefill_args), decode_args=shlex.split(a.decode_args),
                                router_args=shlex.split(a.router_args), startup_timeout_s=a.startup_timeout)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"pdcluster bench: the cluster did not start: {exc}\n{cluster.log_tails()}", file=sys.stderr)
            return 2, {}
        assert url is not None
        p, d = cluster.prefills[0], cluster.decodes[0]
        print(f"launched {', '.join(f'{n.name} {n.url}' for n in cluster.nodes)}; router {a.router} {url}; pids "
              f"{' '.join(str(proc.pid) for proc in cluster.procs.values())}; logs in {cluster.logdir}", flush=True)
        router = Target(url=url)
        direct = Target(prefill=p.url, decode=d.url, bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port)
        warm = make_workload(max(a.warmup_requests, 1) * 4, min(16, a.input_len), 4, 1.0, vocab_size,
                             float("inf"), a.seed + 1)
        asyncio.run(_pairs(router, direct, warm, a.seed + 1, a.request_timeout))
        reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab_size, float("inf"), a.seed)
        load_before = os.getloadavg()
        print(f"sending {len(reqs)} requests twice, one at a time: through the {a.router} router and straight to "
              f"the pair, in random order per pair; load average {load_before[0]:.2f}", flush=True)
        cpu_before = cluster.cpu_seconds()
        pairs = asyncio.run(_pairs(router, direct, reqs, a.seed, a.request_timeout))
        router_cpu = cluster.cpu_seconds().get("router", 0.0) - cpu_before.get("router", 0.0)
        load_after = os.getloadavg()
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
    failed = [r.error or d.error for r, d in pairs if not (r.ok and d.ok)]
    summary = {
        "router": a.router, "pairs": len(pairs), "failed": len(failed),
        "through_router": {"ttft_ms": report.distribution_ms([r.ttft_s for r, _ in pairs if r.ok and r.ttft_s]),
                           "e2e_ms": report.distribution_ms([r.e2e_s for r, _ in pairs if r.ok and r.e2e_s])},
        "direct": {"ttft_ms": report.distribution_ms([d.ttft_s for _, d in pairs if d.ok and d.ttft_s]),
                   "e2e_ms": report.distribution_ms([d.e2e_s for _, d in pairs if d.ok and d.e2e_s])},
        "added_ms": {"ttft": _diffs_ms(pairs, "ttft_s"), "e2e": _diffs_ms(pairs, "e2e_s")},
        "router_cpu_s_per_1000": round(router_cpu / max(len(pairs), 1) * 1000, 3),
        "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
    }
    print(format_paired(summary))
    if failed:
        print(f"{len(failed)} pairs had a failure; first: {failed[0]}")
    return (0 if not failed else 1), {"args": {k: str(v) for k, v in vars(a).items()}, "paired": summary}


def format_paired(s: dict) -> str:
    lines = [f"==== added by the {s['router']} router ({s['pairs']} pairs, {s['failed']} failed)",
             f"{'(ms)':<22}{'p50':>9}{'p99':>9}"]
    for name in ("through_router", "direct"):
        for metric in ("ttft_ms", "e2e_ms"):
            dist = s[name][metric] or {}
            lines.append(f"{name + ' ' + metric[:-3].upper():<22}{dist.get('p50', float('nan')):>9.2f}"
                         f"{dist.get('p99', float('nan')):>9.2f}")
    for metric in ("ttft", "e2e"):
        dist = s["added_ms"][metric] or {}
        lines.append(f"added {metric.upper()} per pair: p10 {dist.get('p10', float('nan')):.2f}, p50 "
                     f"{dist.get('p50', float('nan')):.2f}, p90 {dist.get('p90', float('nan')):.2f}, "
                     f"mean {dist.get('mean', float('nan')):.2f} ms")
    lines.append(f"router CPU seconds per 1000 requests: {s['router_cpu_s_per_1000']:.2f}")
    load = s["load_average"]
    lines.append(f"load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after, on {load['cpus']} CPUs")
    return "\n".join(lines)
