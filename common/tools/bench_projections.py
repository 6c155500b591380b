"""``python -m common.tools.bench_projections``: a model's projections alone, each CPU layout side
by side (common/models/linear.py): our kernel's blocked weights, oneDNN's packed ones and MKL's
plain ones.

The shapes are a checkpoint's (its config.json: q/k/v fused, o, gate/up fused and down per layer,
as the llama family's layers hold them), the weights random, one copy per layer so that, as in a
decode step, each layer's weights come from memory, packed as a node packs them (``pack_linears``:
ours in one arena of 2-MiB pages). Per row count: the median of ``--repeat``
passes over every projection (after one warm-up), GB/s of weights read and GFLOP/s, for each
layout, and the ratio of each to our kernel.

    python -m common.tools.bench_projections --model-path DIR [--rows 1,8,32,128,512]
        [--layouts native,packed,plain] [--repeat 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from common import kernels
from common.models.linear import linear, pack_linears


def projection_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every projection, layer by layer, as a llama-family checkpoint's layers fuse them."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"]


class _Projection(nn.Module):
    PACKED_LINEARS = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


def _weights(layout: str, shapes: list[tuple[int, int]]) -> list:
    """Random weights of these shapes in one layout, packed as a node packs them (``pack_linears``:
    ours all in one arena of huge pages, oneDNN's each reordered)."""
    model = nn.ModuleList(_Projection(torch.randn(n, k) * 0.02) for n, k in shapes)
    if layout == "native":
        kernel = kernels.linear()
        assert kernel is not None
        pack_linears(model, native=kernel)
    elif layout == "packed":
        pack_linears(model)
    return [m.weight for m in model]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_projections", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a checkpoint directory (only config.json is read)")
    p.add_argument("--rows", default="1,8,32,128,512")
    p.add_argument("--layouts", default="native,packed,plain")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shapes = projection_shapes(json.loads((Path(a.model_path) / "config.json").read_text()))
    layouts = [x for x in a.layouts.split(",") if x != "native" or kernels.linear() is not None]
    weights = {layout: _weights(layout, shapes) for layout in layouts}
    elements = sum(n * k for n, k in shapes)
    print(f"{len(shapes)} projections, {elements * 4 / 1e6:.0f} MB of float32 weights, {a.threads} thread(s); "
          f"layouts: {', '.join(layouts)}")
    print("| rows | " + " | ".join(f"{x} ms (GB/s, GFLOP/s)" for x in layouts) + " | " +
          " | ".join(f"{x} / {layouts[0]}" for x in layouts[1:]) + " |")
    print("| ---: |" + " ---: |" * (2 * len(layouts) - 1))
    widest = max(k for _, k in shapes)
    for rows in (int(x) for x in a.rows.split(",")):
        x = torch.randn(rows, widest)
        inputs = {k: x[:, :k].contiguous() for k in {k for _, k in shapes}}
        ms = {}
        for layout in layouts:
            def run(ws=weights[layout]) -> None:
                for (_, k), w in zip(shapes, ws):
                    linear(inputs[k], w)

            run()
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            ms[layout] = statistics.median(times) * 1e3
        cells = [f"{ms[x]:.2f} ({elements * 4 / ms[x] / 1e6:.1f}, {2 * elements * rows / ms[x] / 1e6:.0f})" for x in layouts]
        ratios = [f"{ms[x] / ms[layouts[0]]:.2f}x" for x in layouts[1:]]
        print(f"| {rows} | " + " | ".join(cells + ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
