"""Where one CUDA-graph decode step's time goes (run by scripts/gpu/device_check.sh on a GPU).

For each batch size: the wall time of ``DecodeGraphs.run`` (what a decode step pays), the device
time of the graph replay alone (CUDA events), and from the torch profiler the number of kernels
one replay launches and their summed device time, so the gap between the replay's span and its
kernels' time (launch gaps) and the host work around it (planning, input copy) are separated.

    python scripts/gpu/profile_decode.py MODEL_DIR [--batch 1,64] [--context 1024]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve  # noqa: E402
from common.engine.model_runner import ExtendChunk, ModelRunner  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_path")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    batches = [int(b) for b in a.batch.split(",")]
    most = max(batches)
    cfg = resolve(NodeConfig(role="decode", model=ModelConfig(model_path=a.model_path, device="cuda", dtype="bfloat16"),
                             cache=CacheConfig(page_size=16, max_total_tokens=most * (a.context + 64) + 1024,
                                               max_running_requests=most, enable_prefix_cache=False),
                             attention=AttentionConfig(backend="flashinfer", cuda_graph_max_bs=most)))
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    graphs = runner.graphs
    assert graphs is not None
    kvs = []
    for i in range(most):
        prompt = [(7 * i + j) % (runner.arch.vocab_size - 3) + 3 for j in range(a.context)]
        kv = runner.memory.admit(prompt, use_cache=False)
        assert kv is not None and runner.memory.reserve(kv, a.context + 64)
        runner.extend([ExtendChunk(kv.row, prompt, 0)])
        kvs.append(kv)
    print("| batch | run() wall us | replay device us | kernels / replay | kernel time us | host around replay us |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        rows, pos, ids = [kv.row for kv in kvs[:b]], [a.context] * b, [5] * b
        for _ in range(5):
            graphs.run(ids, pos, rows)
        torch.cuda.synchronize()
        walls = []
        for _ in range(50):
            t0 = time.perf_counter()
            graphs.run(ids, pos, rows)
            torch.cuda.synchronize()
            walls.append(1e6 * (time.perf_counter() - t0))
        bs = graphs.size_for(b)
        replay = graphs._replay[bs]
        spans = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            replay()
            e.record()
            e.synchronize()
            spans.append(1000 * s.elapsed_time(e))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        k_us = sum(ev.device_time for ev in kernels) if kernels else float("nan")
        wall, span = statistics.median(walls), statistics.median(spans)
        print(f"| {b} | {wall:.0f} | {span:.0f} | {len(kernels)} | {k_us:.0f} | {wall - span:.0f} |", flush=True)
        if b == batches[0]:
            names: dict[str, list[float]] = {}
            for ev in kernels:
                names.setdefault(ev.name[:60], []).append(ev.device_time)
            print("  most frequent kernels (count, mean us):")
            for name, ts in sorted(names.items(), key=lambda kv: -len(kv[1]))[:12]:
                print(f"    {len(ts):4d}  {statistics.mean(ts):6.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
