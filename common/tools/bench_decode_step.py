"""``python -m common.tools.bench_decode_step``: one decode step of the engine alone, no
scheduler, no transfer, no HTTP: the forward + sampling a decode node runs per step, at several
batch sizes, with the torch backend's decode mirror on or off.

Per batch size B: B requests of ``--context`` random prompt tokens are prefilled (not timed),
then ``--warmup`` and ``--steps`` greedy decode steps run, each request's context growing by one
token per step (as in serving: the mirror appends, the gather path re-reads everything). It
prints ms per step and per token (the mean of the timed steps at a steady mirror capacity: a step
that grew the mirror is reported on its own line, see ``step_ms``); the model and threads are
those of a node (``--cpu-threads``, default 1, as ``pdcluster up`` gives each node on a 2-core box).

    python -m common.tools.bench_decode_step --model-path DIR [--batch 1,8,20,32] [--context 160]
        [--steps 200] [--page-size 16] [--torch-decode-mirror-mib 1024|0] [--json PATH]
        [--limits LIMITS.json|measure]

With ``--limits`` (the ``--json`` of ``python -m common.tools.bench_limits``, or ``measure`` to
measure them in this process just before the steps) each row also shows
the step's roofline, max(bytes read / bandwidth, FLOPs / peak) for the row of ``--cpu-threads``
(common/tools/roofline.py, at the mean context of the timed steps), and the measured step over it.

``--prefill 512,2048`` times the other half of a request's life on the same set-up: one prompt of
each length prefilled in one forward (no prefix cache, logits for its last token), ``--prefill-repeat``
times after one warm-up; it prints the median seconds and the model FLOPs per second
(``roofline.prefill_flops``), with ``--limits`` also as a share of the measured matmul peak.
``--batch ""`` skips the decode steps.

On a GPU (``--device cuda``): ``--dtype bfloat16`` and ``--attention-backend flashinfer`` as a
node would run, decode steps replaying CUDA graphs unless ``--disable-cuda-graph``, and the
roofline from the device's own limits, measured first (``bench_limits.gpu_limits``: read
bandwidth of a large sum, bf16 matmul peak) unless ``--limits`` names a file.

    python -m common.tools.bench_decode_step --model-path DIR --device cuda --dtype bfloat16
        --batch 1,8,32,64 --context 1024 --prefill 512,2048 [--disable-cuda-graph]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common import host_malloc
from common.config import AttentionConfig, CacheConfig, ConfigError, ModelConfig, NodeConfig, resolve
from common.cpu_isa import cpu_isa
from common.engine.driver import EngineDriver, SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk, ModelRunner
from common.engine.sampler import Sampler
from common.models import ModelLoadError
from common.request import SamplingParams
from common.tools import bench_limits, roofline

# ``--limits measure``: bench_limits' defaults (a buffer far past the last-level cache, a product
# long enough to reach the FMAs' peak), measured right before the steps. Why: on a shared host the
# limits move with the neighbours' load (26.9 -> 23.8 GB/s within three hours on one Zen 4 guest),
# and a file measured earlier turns that drift into a ratio that is not the step's.
MEASURE_MIB, MEASURE_N, MEASURE_REPEAT = 512, 1024, 5


@dataclass
class StepTimes:
    steady_ms: list[float]  # timed steps that kept the decode mirror's buffers
    growth_ms: list[float]  # timed steps that allocated them anew (a growth of its capacity)

    @property
    def mean_ms(self) -> float:
        """The step's time at a steady capacity: what ``ms / step`` reports."""
        return statistics.mean(self.steady_ms or self.growth_ms)

    @property
    def mean_all_ms(self) -> float:
        return statistics.mean(self.steady_ms + self.growth_ms)


def step_ms(runner: ModelRunner, batch: int, context: int, warmup: int, steps: int, seed: int) -> StepTimes:
    """Wall ms of each timed decode step of ``batch`` requests, those that reallocated the decode
    mirror apart; frees everything it took.

    Why apart: the mirror's capacity doubles when a lane outgrows it, and that step copies every
    lane into new buffers (page faults on fresh memory: 150 ms at 32 lanes x 192 positions of
    SmolLM2's shape on a Zen 4 guest). A serving node does that while its capacities grow to the
    longest context and largest batch it sees, then no more; whether a timed window of a few dozen
    steps happens to cross a doubling (160 + 5 + 30 positions does, at 192) is not the step's cost."""
    driver, memory = EngineDriver(runner, Sampler()), runner.memory
    # Each batch size from an empty decode mirror, as ``--batch N`` alone runs it: a mirror an
    # earlier batch size grew keeps its larger key capacity, so a row would depend on the list.
    runner.attn_backend.reset()
    rng = random.Random(seed)
    vocab = runner.arch.vocab_size
    greedy = SamplingParams(max_new_tokens=warmup + steps + 1, temperature=0.0, ignore_eos=True)
    reqs = []
    for _ in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        kv = memory.admit(prompt)
        if kv is None or not memory.reserve(kv, context + warmup + steps + 1):
            raise SystemExit(f"bench_decode_step: the KV pool does not hold {batch} x {context + warmup + steps} tokens")
        reqs.append((kv, prompt, [], SampleSpec(greedy, [], prompt)))
    driver.run_extend([ExtendChunk(kv.row, p, 0) for kv, p, _, _ in reqs], [s for *_, s in reqs])
    for kv, p, out, _ in reqs:
        kv.kv_len = len(p)
        out.append(rng.randrange(3, vocab))

    def one() -> None:
        toks = driver.run_decode([DecodeItem(kv.row, out[-1], kv.kv_len) for kv, _, out, _ in reqs], [s for *_, s in reqs])
        for (kv, _, out, _), t in zip(reqs, toks):
            kv.kv_len += 1
            out.append(t.token_id)

    for _ in range(warmup):
        one()
    mirror = getattr(runner.attn_backend, "mirror", None)
    times = StepTimes([], [])
    for _ in range(steps):
        generation = None if mirror is None else mirror.generation
        t0 = time.perf_counter()
        one()
        ms = (time.perf_counter() - t0) * 1000
        (times.steady_ms if mirror is None or mirror.generation == generation else times.growth_ms).append(ms)
    for kv, p, out, _ in reqs:
        memory.release(kv, None)
    memory.check_integrity()
    return times


def prefill_s(runner: ModelRunner, tokens: int, warmup: int, repeat: int, seed: int) -> list[float]:
    """Wall seconds of each timed prefill of one ``tokens``-token prompt; frees what it took."""
    driver, memory = EngineDriver(runner, Sampler()), runner.memory
    rng = random.Random(seed)
    vocab = runner.arch.vocab_size
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(warmup + repeat):
        prompt = [rng.randrange(3, vocab) for _ in range(tokens)]  # a fresh prompt each time
        kv = memory.admit(prompt)
        if kv is None or not memory.reserve(kv, tokens):
            raise SystemExit(f"bench_decode_step: the KV pool does not hold a {tokens}-token prompt")
        t0 = time.perf_counter()
        driver.run_extend([ExtendChunk(kv.row, prompt, 0)], [SampleSpec(greedy, [], prompt)])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        memory.release(kv, None)
    memory.check_integrity()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", default="1,8,20,32", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=160, help="prompt tokens per request before the first step")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--torch-decode-mirror-mib", type=int, default=AttentionConfig.torch_decode_mirror_mib)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--limits", default=None,
                   help="bench_limits --json output, or 'measure' (measure them first, in this process): "
                        "report each step against its roofline")
    p.add_argument("--prefill", default="", help="comma-separated prompt lengths to time one prefill of each")
    p.add_argument("--prefill-repeat", type=int, default=5)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=AttentionConfig.cuda_graph_max_bs)
    p.add_argument("--cpu-linear", default=ModelConfig.cpu_linear, choices=("auto", "packed", "native", "bf16", "plain"),
                   help="CPU projections as a node would run them (common/models/linear.py)")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch.split(",") if b]
    prefills = [int(n) for n in a.prefill.split(",") if n]
    if not (batches or prefills):
        print("bench_decode_step: nothing to time (--batch is empty and no --prefill)", file=sys.stderr)
        return 2
    if (batches and min(batches) < 1) or (prefills and min(prefills) < 1) or a.prefill_repeat < 1:
        print("bench_decode_step: batch sizes, --prefill lengths and --prefill-repeat must be >= 1", file=sys.stderr)
        return 2
    if a.context < 1 or a.steps < 1 or a.warmup < 0 or a.cpu_threads < 1:
        print("bench_decode_step: batch sizes, --context, --steps and --cpu-threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(a.cpu_threads)
    host_malloc.tune()  # as a node's scheduler process does
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"bench_decode_step: --device {a.device}, but torch sees no CUDA device", file=sys.stderr)
        return 2
    most = max(batches, default=1)
    tokens = max(most * (a.context + a.warmup + a.steps + 1), max(prefills, default=0))
    try:
        cfg = resolve(NodeConfig(
            role="decode",
            model=ModelConfig(model_path=a.model_path, device=a.device, dtype=a.dtype, cpu_linear=a.cpu_linear),
            cache=CacheConfig(page_size=a.page_size, max_total_tokens=tokens + most * a.page_size,
                              max_running_requests=most, enable_prefix_cache=False),
            attention=AttentionConfig(backend=a.attention_backend if cuda else "torch",
                                      torch_decode_mirror_mib=a.torch_decode_mirror_mib,
                                      cuda_graph_max_bs=a.cuda_graph_max_bs, disable_cuda_graph=a.disable_cuda_graph),
        ))
        runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    except (ConfigError, ModelLoadError) as exc:
        print(f"bench_decode_step: {exc}", file=sys.stderr)
        return 2
    limit_row, shape, dtype_bytes = None, None, 4
    if cuda and a.limits in (None, "measure"):  # a device measures its own limits here either way
        limit_row = bench_limits.gpu_limits(a.device)
        print(f"device {torch.cuda.get_device_name(a.device)}: read {limit_row['read_gbs']:.0f} GB/s, copy (read + write) "
              f"{limit_row['copy_gbs']:.0f} GB/s, bf16 matmul {limit_row['bf16_gflops'] / 1000:.0f} TFLOP/s", flush=True)
    if limit_row is not None or a.limits:
        model_cfg = json.loads((Path(a.model_path) / "config.json").read_text())
        shape = roofline.Shape.from_config(model_cfg)
        dtype_bytes = runner.kv_pool.k_buffers[0].element_size()
    if a.limits == "measure" and not cuda:
        limit_row = bench_limits.measure([a.cpu_threads], MEASURE_MIB, MEASURE_N, MEASURE_REPEAT, cpu_isa()["bf16"])[0]
        print(f"limits measured now ({a.cpu_threads} thread(s), best of {MEASURE_REPEAT}): read "
              f"{limit_row['read_gbs']:.1f} GB/s, fp32 {limit_row['fp32_gflops']:.1f} GFLOP/s", flush=True)
    elif a.limits and a.limits != "measure":
        try:
            limit_row = bench_limits.for_threads(bench_limits.load(a.limits), a.cpu_threads)
        except (OSError, ValueError) as exc:
            print(f"bench_decode_step: --limits: {exc}", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    peak_gflops = None
    if limit_row is not None:
        # bfloat16 products (a bf16 model, or --cpu-linear bf16's projections) against the bf16 peak
        bf16 = dtype_bytes == 2 or getattr(runner, "cpu_linear", "") == "bf16"
        peak_gflops = limit_row["bf16_gflops" if bf16 and "bf16_gflops" in limit_row else "fp32_gflops"]
    prefill_rows: list[dict[str, float]] = []
    prefill_shape = roofline.Shape.from_config(runner_config(a.model_path))
    if prefills:
        print(f"model {a.model_path}, one prompt per length, {a.cpu_threads} thread(s)")
    for n in prefills:
        times = sorted(prefill_s(runner, n, 1, a.prefill_repeat, a.seed))
        med = statistics.median(times)
        gflops = roofline.prefill_flops(prefill_shape, n) / med / 1e9
        prow: dict[str, float] = {"tokens": n, "median_s": med, "min_s": times[0], "max_s": times[-1], "gflops": gflops}
        line = (f"prefill {n} tokens: median {med * 1000:.1f} ms (min {times[0] * 1000:.1f}, max {times[-1] * 1000:.1f}, "
                f"{len(times)} runs), {gflops:.1f} GFLOP/s")
        if peak_gflops is not None:
            prow["of_peak"] = gflops / peak_gflops
            line += f", {100 * gflops / peak_gflops:.0f} % of the {peak_gflops:.1f} GFLOP/s peak"
        prefill_rows.append(prow)
        print(line, flush=True)
    if batches:
        decode_rows(runner, a, batches, limit_row, shape, dtype_bytes, peak_gflops, rows)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"args": vars(a), "limits": limit_row, "rows": rows, "prefill": prefill_rows}, f, indent=1)
    return 0


def runner_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json (the runner has already loaded it, so it is readable)."""
    return json.loads((Path(model_path) / "config.json").read_text())


def decode_rows(runner: ModelRunner, a: argparse.Namespace, batches: list[int], limit_row: dict[str, float] | None,
                shape: roofline.Shape | None, dtype_bytes: int, peak_gflops: float | None,
                rows: list[dict[str, Any]]) -> None:
    """Time each batch size's decode step; print its row and append it to ``rows``."""
    graphs = getattr(runner, "graphs", None)
    engine = (f"{a.device}, {runner.dtype}, attention {type(runner.attn_backend).__name__}, CUDA graphs "
              f"{'up to batch %d' % graphs.max_batch_size if graphs is not None else 'off'}" if a.device != "cpu"
              else f"mirror {a.torch_decode_mirror_mib} MiB, {a.cpu_threads} thread(s)")
    print(f"model {a.model_path}, context {a.context} (+1 per step), page size {a.page_size}, {engine}")
    if limit_row is None:
        print("| batch | ms / step | us / token |\n| ---: | ---: | ---: |")
    else:
        source = a.limits or a.device
        print(f"roofline from {source}: {limit_row['threads']} thread(s), {limit_row['read_gbs']:.1f} GB/s, "
              f"{(peak_gflops or limit_row['fp32_gflops']):.1f} GFLOP/s")
        print("| batch | ms / step | us / token | roofline ms | x roofline |\n| ---: | ---: | ---: | ---: | ---: |")
    weight_bytes = 2 if getattr(runner, "cpu_linear", "") == "bf16" else None  # bfloat16 projections
    for b in batches:
        times = step_ms(runner, b, a.context, a.warmup, a.steps, a.seed)
        ms = times.mean_ms
        row: dict[str, Any] = {"batch": b, "ms_per_step": ms, "us_per_token": 1000 * ms / b,
                               "mean_all_ms": times.mean_all_ms, "growth_steps_ms": times.growth_ms}
        line = f"| {b} | {ms:.3f} | {1000 * ms / b:.1f} |"
        if limit_row is not None and shape is not None:
            ctx = a.context + a.warmup + a.steps // 2  # the mean context of the timed steps
            assert peak_gflops is not None
            roof_ms = 1000 * roofline.roofline_s(roofline.decode_flops(shape, b, ctx),
                                                 roofline.decode_bytes(shape, b, ctx, dtype_bytes, weight_bytes),
                                                 peak_gflops * 1e9, limit_row["read_gbs"] * 1e9)
            row.update(roofline_ms=roof_ms, x_roofline=ms / roof_ms)
            line += f" {roof_ms:.3f} | {ms / roof_ms:.2f} |"
        rows.append(row)
        print(line, flush=True)
        if times.growth_ms:
            print(f"  (batch {b}: {len(times.growth_ms)} timed step(s) grew the decode mirror, "
                  f"{', '.join(f'{t:.1f}' for t in times.growth_ms)} ms, left out of ms / step; "
                  f"the mean of every timed step: {times.mean_all_ms:.3f} ms)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
