"""``python -m common.tools.bench_limits``: this machine's limits, measured with torch.

Per thread count (1..the cores this process may use): memory read bandwidth (a sum over a
float32 buffer far larger than the caches, each byte read once per pass, in 4-KiB pages and in
2-MiB pages, the limit being the faster of the two) and matmul peak: a
square float32 product on each kernel torch has (``torch.mm``, i.e. MKL's sgemm, and oneDNN's
linear over a prepacked weight, the kernel packed projections run on), the peak being the faster
of the two; bfloat16 too when the CPU has AVX512-BF16 or AMX, where torch's oneDNN path runs it
natively. Both kernels count because neither is the machine's peak everywhere: MKL picks its
AVX2 code on AMD CPUs even where they have AVX-512 (an AMD EPYC with AVX-512: 105 GFLOP/s for
MKL against 245 for oneDNN, one thread), so dividing by MKL's figure there reads more than
100 %. Best of ``--repeat`` timed passes after one warm-up, because the question is what the
machine can do, not what a noisy neighbour left. Prints a table; ``--json``
writes the same numbers for bench / bench_decode_step to divide by (``--limits PATH`` there).

    python -m common.tools.bench_limits [--threads 1,2] [--mib 512] [--n 1024] [--repeat 5]
        [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import hugepages
from common.cpu_budget import allowed_cpus
from common.cpu_isa import ISA_FLAGS, cpu_isa


def _best_s(fn: Any, repeat: int) -> float:
    fn()  # warm-up: first-touch pages, oneDNN primitive creation
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(mib: int, repeat: int, huge: bool = False) -> float:
    """Bytes/s of one pass summing a ``mib`` MiB float32 buffer: torch's own allocation (4-KiB
    pages), or with ``huge`` one advised into 2-MiB pages (common/hugepages.py: where the packed
    weights live). Both count because the page size moves the answer: on a 2-vCPU AMD EPYC Zen 4
    guest the same sum read 25.5-26.4 GB/s from small pages and 28.3-28.9 from huge ones
    (docs/BENCHMARKS.md, "The read limit in 2-MiB pages"), and a decode step whose weights stream
    from huge pages was being divided by the smaller figure."""
    n = mib * 2**20 // 4
    buf = hugepages.zeros((n,), huge=True) if huge else torch.empty(n, dtype=torch.float32)  # [mib MiB / 4 bytes]
    buf.fill_(1.0)
    return buf.numel() * 4 / _best_s(lambda: buf.sum(), repeat)


def matmul_peak(n: int, dtype: torch.dtype, repeat: int) -> float:
    """FLOP/s of one ``n`` x ``n`` by ``n`` x ``n`` matmul (2 n^3 FLOPs), ``torch.mm``."""
    a = torch.randn(n, n).to(dtype)  # [n, n]
    b = torch.randn(n, n).to(dtype)  # [n, n]
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b), repeat)


def onednn_peak(n: int, repeat: int) -> float | None:
    """FLOP/s of the same float32 product on oneDNN's linear over a prepacked weight (the
    engine's packed projections, common/models/linear.py); None where torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    a = torch.randn(n, n)  # [n, n]
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, n))  # [n, n], oneDNN's blocked layout
    return 2 * n**3 / _best_s(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), repeat)


def gpu_limits(device: str, mib: int = 2048, n: int = 8192, repeat: int = 10) -> dict[str, float]:
    """A CUDA device's limits in the row format ``--limits`` readers take (``threads`` 0): read
    bandwidth (one sum over a ``mib`` MiB float32 buffer, each byte read once), copy bandwidth
    (bytes read plus written by a device-to-device copy) and bf16 / fp32 matmul peak (``n``-sided,
    random data). Median of ``repeat`` event-timed runs after a warm-up."""
    dev = torch.device(device)

    def median_s(fn: Any) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return sorted(times)[len(times) // 2]

    def bandwidths() -> dict[str, float]:
        buf = torch.rand(mib * 2**20 // 4, dtype=torch.float32, device=dev)  # [mib MiB / 4 bytes]
        dst = torch.empty_like(buf)
        return {"read_gbs": buf.numel() * 4 / median_s(lambda: buf.sum()) / 1e9,
                "copy_gbs": 2 * buf.numel() * 4 / median_s(lambda: dst.copy_(buf)) / 1e9}

    def peak(dtype: torch.dtype) -> float:
        a, b = torch.randn(n, n, device=dev).to(dtype), torch.randn(n, n, device=dev).to(dtype)  # [n, n]
        return 2 * n**3 / median_s(lambda: torch.mm(a, b)) / 1e9

    row = {"threads": 0, **bandwidths(), "bf16_gflops": peak(torch.bfloat16), "fp32_gflops": peak(torch.float32)}
    torch.cuda.empty_cache()
    return row


def measure(threads: list[int], mib: int, n: int, repeat: int, bf16: bool) -> list[dict[str, float]]:
    rows = []
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            mkl = matmul_peak(n, torch.float32, repeat) / 1e9
            onednn = onednn_peak(n, repeat)
            small = read_bandwidth(mib, repeat) / 1e9
            huge = read_bandwidth(mib, repeat, huge=True) / 1e9
            row = {"threads": t, "read_gbs": max(small, huge), "read_small_pages_gbs": small,
                   "read_huge_pages_gbs": huge, "fp32_mm_gflops": mkl}
            if onednn is not None:
                row["fp32_onednn_gflops"] = onednn / 1e9
            row["fp32_gflops"] = max(mkl, row.get("fp32_onednn_gflops", 0.0))  # what --limits readers divide by
            if bf16:
                row["bf16_gflops"] = matmul_peak(n, torch.bfloat16, repeat) / 1e9
            rows.append(row)
    finally:
        torch.set_num_threads(before)
    return rows


def for_threads(limits: dict[str, Any], threads: int) -> dict[str, float]:
    """The row of a ``--json`` result for ``threads`` (the largest measured count not above it)."""
    rows = sorted(limits["rows"], key=lambda r: r["threads"])
    fit = [r for r in rows if r["threads"] <= threads] or rows[:1]
    return fit[-1]


def load(path: str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not data.get("rows"):
        raise ValueError(f"{path}: no 'rows' (write it with python -m common.tools.bench_limits --json)")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_limits", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default=None, help="comma list of thread counts (default: 1..cores)")
    p.add_argument("--mib", type=int, default=512, help="bandwidth buffer size, far above the last-level cache")
    p.add_argument("--n", type=int, default=1024, help="matmul side")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the result here")
    ns = p.parse_args(argv)
    cores = len(allowed_cpus())
    try:
        threads = [int(x) for x in ns.threads.split(",")] if ns.threads else list(range(1, cores + 1))
    except ValueError:
        p.error(f"--threads {ns.threads!r}: expected a comma list of integers")
    if any(t < 1 for t in threads) or ns.mib < 1 or ns.n < 1 or ns.repeat < 1:
        p.error("--threads, --mib, --n and --repeat must be >= 1")
    isa = cpu_isa()
    bf16 = isa["bf16"]
    rows = measure(threads, ns.mib, ns.n, ns.repeat, bf16)
    head = (f"{'threads':>7} {'read GB/s':>10} {'(4 KiB':>7} {'2 MiB)':>7} {'fp32 GFLOP/s':>13} {'(mm':>8} {'oneDNN)':>8}"
            + (f" {'bf16 GFLOP/s':>13}" if bf16 else ""))
    print(f"# torch {torch.__version__}, {cores} cores available, bf16 instructions: {'yes' if bf16 else 'no'}, "
          f"int8 (VNNI/AMX): {'yes' if isa['int8'] else 'no'}; flags: {' '.join(f for f in ISA_FLAGS if isa[f]) or 'none'}")
    print(head)
    for r in rows:
        onednn = f"{r['fp32_onednn_gflops']:.1f}" if "fp32_onednn_gflops" in r else "-"
        line = (f"{r['threads']:>7} {r['read_gbs']:>10.1f} {r['read_small_pages_gbs']:>7.1f} {r['read_huge_pages_gbs']:>7.1f}"
                f" {r['fp32_gflops']:>13.1f} {r['fp32_mm_gflops']:>8.1f} {onednn:>8}")
        print(line + (f" {r['bf16_gflops']:>13.1f}" if bf16 else ""))
    if ns.json:
        out = {"torch": torch.__version__, "cores": cores, "bf16": bf16, "isa": isa, "mib": ns.mib, "n": ns.n, "rows": rows}
        Path(ns.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
