"""``python -m common.tools.bench_decode_attention``: a decode step's attention alone, our C++
kernel (common/kernels/) against the torch ops it replaces, over every layer's mirror.

One float32 query per lane against its lane's keys and values, laid out as the decode mirror
keeps them, one buffer per layer so that, as in a real step, a layer's keys come from memory and
not from the cache the previous layer left. Per shape: the median of ``--repeat`` passes over all
the layers (after one warm-up), and the K and V bytes read per second, to set against
``bench_limits``' read bandwidth. The kernel runs on both key layouts (decode_mirror.py): plain
transposed keys, and keys in blocks of 64 positions (what a node's mirror holds for the kernel).

    python -m common.tools.bench_decode_attention [--heads 9 --kv-heads 3 --head-dim 64]
        [--lanes 8,32] [--keys 175,400] [--layers 30] [--repeat 15] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from common import kernels
from common.attention.base import AttentionLayerSpec
from common.attention.decode_mirror import KEY_BLOCK, MirrorPlan
from common.attention.torch_backend import _one_query_attention


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_shape(heads: int, kv_heads: int, dim: int, lanes: int, keys: int, layers: int, repeat: int,
              kernel: kernels.DecodeAttention | None) -> dict[str, float]:
    """ms over all layers and GB/s of K+V read, for the torch ops and (if built) the kernel."""
    s_cap = -(-keys // 64) * 64
    mk = [torch.randn(lanes, kv_heads, dim, s_cap) for _ in range(layers)]
    w = KEY_BLOCK  # the same keys in blocks: [lanes, kv_heads, s_cap / KEY_BLOCK, dim, KEY_BLOCK]
    mk_blocked = [k.view(lanes, kv_heads, dim, s_cap // w, w).permute(0, 1, 3, 2, 4).contiguous() for k in mk]
    mv = [torch.randn(lanes, kv_heads, s_cap, dim) for _ in range(layers)]
    q = torch.randn(lanes, heads, dim)
    lens = torch.full((lanes,), keys, dtype=torch.int32)
    plan = MirrorPlan(num_lanes=lanes, max_seq=keys, lanes=torch.arange(lanes), positions=lens.long() - 1,
                      to_lane=None, from_lane=None, lane_lens=lens, mask=None, bias=None, fills=[], moves=[],
                      done_layers=set())
    spec = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    nbytes = layers * lanes * kv_heads * keys * dim * 4 * 2

    def ops() -> None:
        for k, v in zip(mk, mv):
            _one_query_attention(q, k[:, :, :, :keys], v[:, :, :keys], spec, plan)

    out = {"ops_ms": _median_s(ops, repeat) * 1e3}
    out["ops_gbs"] = nbytes / out["ops_ms"] / 1e6
    if kernel is not None:
        for name, keys_of_layers in (("plain", mk), ("blocked", mk_blocked)):
            def fused(keys_of_layers: list[torch.Tensor] = keys_of_layers) -> None:
                for k, v in zip(keys_of_layers, mv):
                    kernel(q, k, v, lens, lanes, spec.scaling)

            out[f"{name}_ms"] = _median_s(fused, repeat) * 1e3
            out[f"{name}_gbs"] = nbytes / out[f"{name}_ms"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_decode_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lanes", default="8,32", help="comma-separated lane counts (the decode batch)")
    p.add_argument("--keys", default="175,400", help="comma-separated keys per lane (the context)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    kernel = kernels.decode_attention()
    print(f"heads {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, {a.layers} layers, {a.threads} thread(s), "
          f"kernel {'built' if kernel else 'NOT built (torch ops only)'}")
    print("| lanes | keys | torch ops ms | GB/s | kernel, plain keys ms | GB/s | kernel, blocked keys ms | GB/s "
          "| ops / blocked |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for lanes in (int(x) for x in a.lanes.split(",")):
        for keys in (int(x) for x in a.keys.split(",")):
            r = run_shape(a.heads, a.kv_heads, a.head_dim, lanes, keys, a.layers, a.repeat, kernel)
            cells = [f"{r[f'{n}_ms']:.2f} | {r[f'{n}_gbs']:.1f}" if f"{n}_ms" in r else "- | -"
                     for n in ("plain", "blocked")]
            ratio = f"{r['ops_ms'] / r['blocked_ms']:.2f}x" if "blocked_ms" in r else "-"
            print(f"| {lanes} | {keys} | {r['ops_ms']:.2f} | {r['ops_gbs']:.1f} | {cells[0]} | {cells[1]} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
