"""One ``pdcluster bench`` run against a target, and the launched-cluster variant: what the CLI
(``bench.py``) and its side-by-side and paired variants (``bench_peers.py``, ``bench_paired.py``)
all build on. The run's stages are drawn in bench.py's docstring (its ``--help``).

    bench(args, target, nodes)   warm-up -> idle snapshot -> workload -> idle snapshot -> report
    run_launched(args, model)    LocalCluster.start -> bench(...) -> LocalCluster.stop (also on SIGTERM)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import aiohttp
from tqdm import tqdm

from common.tools import bench_multiturn as mt
from common.tools import bench_report as report
from common.tools.bench_client import RequestResult, Target, send
from common.tools.bench_nodes import compare, format_nodes, get_text, snapshot
from common.tools.bench_plots import write_goodput_plot, write_plots
from common.tools.bench_workload import BenchRequest, make_workload
from common.tools.local_cluster import LocalCluster, get_json

WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 32, 4


def vocab_size(a: argparse.Namespace, info: dict) -> int | None:
    if a.vocab_size is not None:
        return a.vocab_size
    try:
        with open(os.path.join(str(info.get("model_path")), "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- the workload --------------------------------------------------------------------------------


async def run_requests(target: Target, reqs: list[BenchRequest], max_concurrency: int | None,
                       request_timeout_s: float, deadline_s: float,
                       progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send ``reqs`` at their arrival offsets; return one result per request (in order) and the
    duration from the first send to the last answer. Never raises for a request's sake. With
    ``progress``, a bar on stderr counts answers (tqdm leaves it out when stderr is no terminal)."""
    bar = tqdm(total=len(reqs), desc="requests", unit="req", file=sys.stderr, disable=None if progress else True,
               mininterval=0.5, leave=False)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # No pool limit (the semaphore is the cap); a slow connect is its own clear error.
    session_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=session_timeout) as session:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                if sem is None:
                    return await send(session, target, req, t0, request_timeout_s)
                async with sem:
                    return await send(session, target, req, t0, request_timeout_s)
            finally:
                bar.update(1)

        tasks = [asyncio.create_task(one(r)) for r in reqs]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
    bar.close()
    results = []
    for req, task in zip(reqs, tasks):
        if task.cancelled():
            results.append(RequestResult(req.index, req.input_len, req.output_len,
                                         error=f"not finished when the run's --timeout ({deadline_s:g} s) passed"))
        elif (exc := task.exception()) is not None:  # a bench bug: report it, keep the rest
            results.append(RequestResult(req.index, req.input_len, req.output_len,
                                         error=f"bench error: {type(exc).__name__}: {exc}"))
        else:
            results.append(task.result())
    return results, duration


# ---- one run ------------------------------------------------------------------------------------


def bench(a: argparse.Namespace, target: Target, nodes: dict[str, str], cluster: LocalCluster | None = None,
          info: dict | None = None) -> tuple[int, dict]:
    """Run the workload against ``target``; ``nodes`` (name -> URL) get the leak check. Returns
    (exit status, the JSON document); ``info`` stands in for a /server_info the target lacks."""
    target = replace(target, json_schema=bench_schema(a.json_schema))
    # A node's own /server_info when one is known: not every router passes it through.
    info_url = next(iter(nodes.values()), None) or target.url or target.decode
    try:
        info = info if info is not None else get_json(f"{info_url}/server_info")
    except (OSError, ValueError) as exc:
        print(f"pdcluster bench: cannot read {info_url}/server_info: {exc}", file=sys.stderr)
        return 2, {}
    ctx = int(info.get("context_length") or 0)
    multiturn = getattr(a, "workload", None) == "multiturn"
    longest = (mt.longest_prompt(a.input_len, a.turn_len, a.output_len, a.num_turns) if multiturn else a.input_len)
    if ctx and longest + a.output_len > ctx:
        what = "the last turn's prompt + --output-len" if multiturn else "--input-len + --output-len"
        print(f"pdcluster bench: {what} = {longest + a.output_len} exceeds the context length {ctx}", file=sys.stderr)
        return 2, {}
    vocab = vocab_size(a, info)
    if vocab is None:
        print("pdcluster bench: cannot read the model's vocab size; pass --vocab-size", file=sys.stderr)
        return 2, {}
    if a.warmup_requests:
        warm = make_workload(a.warmup_requests, min(WARMUP_INPUT_LEN, a.input_len), WARMUP_OUTPUT_LEN, 1.0,
                             vocab, math.inf, a.seed + 1)
        res, _ = asyncio.run(run_requests(target, warm, None, a.request_timeout, a.request_timeout))
        bad = [r.error for r in res if not r.ok]
        print(f"warm-up: {len(res) - len(bad)}/{len(res)} ok" + (f" (first failure: {bad[0]})" if bad else ""),
              flush=True)
    before = snapshot(nodes, a.idle_timeout)
    turns: list[dict] | None = None
    turn_sum: dict = {}
    load_before = os.getloadavg()
    cpu_before, client_before = (cluster.cpu_seconds() if cluster else None), time.process_time()
    if multiturn:
        convs = mt.make_conversations(a.num_conversations, a.num_turns, a.input_len, a.turn_len, a.output_len,
                                      a.range_ratio, vocab, a.think_time, a.seed, a.request_rate)
        print(f"sending {len(convs)} conversations x {a.num_turns} turns: first prompt up to {a.input_len}, "
              f"{a.turn_len} new tokens and {a.output_len} output tokens per turn (range ratio {a.range_ratio:g}), "
              f"think time {a.think_time:g} s, {a.request_rate:g} conversations/s, max concurrency {a.max_concurrency or 'none'}; "
              f"load average {load_before[0]:.2f}", flush=True)
        results, duration, turns, turn_sum = asyncio.run(mt.run_conversations(
            target, convs, lambda: mt.read_nodes(nodes, get_text), a.max_concurrency, a.request_timeout, a.timeout))
    else:
        reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab, a.request_rate, a.seed,
                             getattr(a, "mix", None), getattr(a, "prompt_salt", None))
        print(f"sending {len(reqs)} requests: input {min(r.input_len for r in reqs)}-{max(r.input_len for r in reqs)}, "
              f"output {min(r.output_len for r in reqs)}-{max(r.output_len for r in reqs)} tokens, rate {a.request_rate:g}/s, "
              f"max concurrency {a.max_concurrency or 'none'}; load average {load_before[0]:.2f}", flush=True)
        results, duration = asyncio.run(run_requests(target, reqs, a.max_concurrency, a.request_timeout, a.timeout,
                                                     progress=True))
    cpu = cpu_used(cpu_before, cluster.cpu_seconds() if cluster else None, time.process_time() - client_before)
    load_after = os.getloadavg()
    summary = report.summarize(results, duration, a.slo_ttft_ms, a.slo_tpot_ms)
    after = snapshot(nodes, a.idle_timeout)
    cmp = compare(before, after)
    leak_clean = all(not c["leak_problems"] for c in cmp.values())
    print(report.format_report(summary))
    if turns is not None:
        print(mt.format_turns(turns, turn_sum))
    print(format_nodes(cmp))
    print(f"CPU seconds during the run ({duration:.2f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs")
    eff = run_prefill_efficiency(a, info, nodes, cmp, results)
    doc = {"args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in vars(a).items()},
           "target": asdict(target), "server_info": info, "summary": summary, "leak_check_clean": leak_clean,
           "nodes": cmp, "before": before, "after": after, "cpu_seconds": cpu,
           "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
           "prefill_efficiency": eff, "requests": [asdict(r) for r in results]}
    if turns is not None:
        doc["turns"] = turns
        doc["turns_summary"] = turn_sum
    if a.json_path:  # pictures for people, next to the JSON; their series go into it too
        doc["plots"] = write_plots(a.json_path, results, duration)
        print("plots: " + ", ".join(p["png"] for p in doc["plots"].values()))
    return (0 if summary["failed"] == 0 and leak_clean else 1), doc


# --json-schema bench: an array of small objects that must hold more items than any run emits, so a
# constrained request runs to --output-len like a free one (same lengths, same work but the masks).
BENCH_SCHEMA = {"type": "array", "minItems": 100000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "tag"], "additionalProperties": False}}


def bench_schema(arg: str | None) -> str | None:
    """--json-schema as JSON text: 'bench', @FILE or the schema itself."""
    if arg is None:
        return None
    if arg == "bench":
        return json.dumps(BENCH_SCHEMA)
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            return f.read()
    json.loads(arg)  # not JSON: fails here; JSON the grammar refuses: every request answers 400 with the reason
    return arg


def sweep(a: argparse.Namespace, run_once: Callable[[], tuple[int, dict]]) -> tuple[int, dict]:
    """``run_once`` as is, or with ``--request-rate-sweep`` once per rate (warm-up only before the
    first). Every rate sends the same shapes (lengths, and arrivals scaled by the rate) with prompts
    of its own (``prompt_salt`` i for the i-th rate), so no rate re-sends what the prefix cache
    holds from the last and the rates differ only in the rate. Each rate's full document goes to
    ``STEM.rate<R>.json`` (and its plots beside it); the returned one lists every rate's goodput and
    SLO attainment, the capacity at ``--slo-attainment`` (``capacity``) and, with --json, the
    goodput-against-rate PNG."""
    rates = getattr(a, "rates", None)
    if not rates:
        return run_once()
    json_path, warmup = a.json_path, a.warmup_requests
    stem = os.path.splitext(json_path)[0] if json_path else None
    rows, worst = [], 0
    try:
        for i, rate in enumerate(rates):
            a.request_rate = rate
            a.warmup_requests = warmup if i == 0 else 0
            a.prompt_salt = i  # new prompts per rate: the same ones would hit the prefix cache of the last
            a.json_path = f"{stem}.rate{rate:g}.json" if stem else None
            print(f"--- rate {rate:g} req/s ({i + 1}/{len(rates)}) ---", flush=True)
            rc, doc = run_once()
            write_json(a.json_path, doc)
            worst = max(worst, rc)
            if not doc:  # the target did not answer: no later rate can run either
                break
            s = doc["summary"]
            good = s["goodput"]["good_requests"]
            rows.append({"rate": rate, "request_goodput": s["goodput"]["request_goodput"],
                         "good_requests": good, "attainment": round(good / a.num_prompts, 4),
                         "request_throughput": s["request_throughput"], "completed": s.get("completed"),
                         "json": a.json_path})
    finally:
        a.json_path, a.warmup_requests, a.prompt_salt = json_path, warmup, None
    print("| rate (req/s) | goodput (req/s) | SLO attainment | completed (req/s) |\n| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['rate']:g} | {r['request_goodput']:.3f} | {100 * r['attainment']:.0f} % | {r['request_throughput']:.3f} |")
    cap = capacity(rows, a.slo_attainment)
    print(f"capacity at {100 * a.slo_attainment:g} % SLO attainment: {format_capacity(cap)}")
    out: dict = {"sweep": rows, "slo_ttft_ms": a.slo_ttft_ms, "slo_tpot_ms": a.slo_tpot_ms,
                 "slo_attainment": a.slo_attainment, "capacity": cap}
    if json_path and rows:
        out["plots"] = {"goodput": write_goodput_plot(f"{stem}.goodput.png", rows)}
        print(f"plot: {stem}.goodput.png")
    return worst, out


def capacity(rows: list[dict], target: float) -> dict:
    """The highest request rate a sweep served with at least ``target`` of its requests within the
    SLO (DistServe's per-GPU goodput, here per machine): the rates are walked up to the first that
    falls short, and the rate is interpolated linearly between that one and the last that held.
    ``{"rate": R, "bound": "="}``; ``"bound": ">="`` when the highest rate still held (the sweep
    stopped short of the limit), ``"<"`` with the lowest rate when even that one fell short."""
    ordered = sorted(rows, key=lambda r: r["rate"])
    if not ordered:
        return {"rate": None, "bound": None}
    last = None
    for r in ordered:
        if r["attainment"] < target:
            if last is None:
                return {"rate": r["rate"], "bound": "<"}
            share = (last["attainment"] - target) / (last["attainment"] - r["attainment"])
            return {"rate": round(last["rate"] + share * (r["rate"] - last["rate"]), 4), "bound": "="}
        last = r
    return {"rate": ordered[-1]["rate"], "bound": ">="}


def format_capacity(cap: dict) -> str:
    if cap["rate"] is None:
        return "-"
    return f"{cap['rate']:g} req/s" if cap["bound"] == "=" else f"{cap['bound']} {cap['rate']:g} req/s"


def run_prefill_efficiency(a: argparse.Namespace, info: dict, nodes: dict[str, str], cmp: dict,
                           results: list[RequestResult]) -> dict | None:
    """With ``--limits``: the run's prefill efficiency (common/tools/bench_efficiency.py), printed."""
    if not getattr(a, "limits", None):
        return None
    from common.tools.bench_efficiency import prefill_efficiency
    from common.tools.bench_limits import load
    from common.tools.roofline import Shape

    prefill_url = next((u for n, u in nodes.items() if n.startswith("prefill")), None)
    try:
        with open(os.path.join(str(info.get("model_path")), "config.json")) as f:
            shape = Shape.from_config(json.load(f))
        pinfo = get_json(f"{prefill_url}/server_info") if prefill_url else {}
        threads = int(pinfo["cpu"]["threads"]) if prefill_url else 0
        bf16 = pinfo.get("cpu_linear") == "bf16" or pinfo.get("dtype") == "bfloat16"
        limits = load(a.limits)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"prefill efficiency: not available ({exc})")
        return None
    eff = prefill_efficiency(shape, results, {n: c["counter_deltas"] for n, c in cmp.items()}, limits, threads, bf16)
    if eff is None:
        print("prefill efficiency: not available (no prefill forward time in the nodes' counters)")
    else:
        print(f"prefill efficiency: {eff['gflops_per_s']:.1f} GFLOP/s over {eff['forward_s']:.2f} s of forwards = "
              f"{100 * eff['efficiency']:.1f} % of the {eff['peak_gflops']:.1f} GFLOP/s peak at "
              f"{eff['threads']:g} thread(s)")
    return eff


def write_json(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def cpu_used(before: dict[str, float] | None, after: dict[str, float] | None, client_s: float) -> dict[str, float]:
    """CPU seconds the run cost each launched process (a node's API process and scheduler group,
    the router) and this client process. On a shared CPU box this, not wall time, says where the
    work went."""
    out = {k: round(after[k] - before.get(k, 0.0), 3) for k in after} if before and after else {}
    out["bench_client"] = round(client_s, 3)
    return out


def exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops a launched cluster


def served_model(url: str) -> str | None:
    """The first model a server lists in /v1/models (what the completions endpoint is asked for)."""
    try:
        return str(get_json(url + "/v1/models")["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def run_launched(a: argparse.Namespace, model: str) -> tuple[int, dict]:
    """Start nodes + router here, run the workload through them, stop them (also on SIGTERM)."""
    cluster = LocalCluster(logdir=tempfile.mkdtemp(prefix="pdc-bench-"))
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        try:
            url = cluster.start(model, backend=a.transfer_backend, page_size=a.page_size, num_prefill=a.num_prefill,
                                num_decode=a.num_decode, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                                prefill_args=shlex.split(a.prefill_args), decode_args=shlex.split(a.decode_args), router=a.router,
                                router_args=shlex.split(a.router_args), startup_timeout_s=a.startup_timeout)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"pdcluster bench: the cluster did not start: {exc}\n{cluster.log_tails()}", file=sys.stderr)
            return 2, {}
        p, d = cluster.prefills[0], cluster.decodes[0]
        target = (Target(url=url, endpoint=a.endpoint, model=served_model(url)) if url else
                  Target(prefill=p.url, decode=d.url, bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port))
        print(f"launched {', '.join(f'{n.name} {n.url}' for n in cluster.nodes)}; router {a.router}"
              f"{' ' + url if url else ''}; transfer backend {a.transfer_backend}, model {model}; pids "
              f"{' '.join(str(proc.pid) for proc in cluster.procs.values())}; logs in {cluster.logdir}", flush=True)
        nodes = {n.name: n.url for n in cluster.nodes}
        return sweep(a, lambda: bench(a, target, nodes, cluster))
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
