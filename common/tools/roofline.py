"""FLOPs and bytes of a llama/qwen-style decoder forward, from its HF ``config.json``.

The one place the benchmarks' efficiency and roofline numbers come from (bench_limits measures
the machine, bench / bench_decode_step divide by it). Counted: the matmuls (2 FLOPs per
multiply-add) of q/k/v/o, gate/up/down and the LM head, plus attention's scores and weighted sum;
norms, rotary, activations and sampling are O(hidden) per token and left out (well under 1 % at
the shapes we run). Bytes: a decode step reads every linear weight once (the batch shares them)
and each request's K and V for its context; activations stay in cache and are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Shape:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]))

    @property
    def layer_weights(self) -> int:
        """Elements of one layer's linear weights: q, k, v, o, gate, up, down."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    @property
    def linear_weights(self) -> int:
        """Elements a forward multiplies by: every layer's linears plus the LM head."""
        return self.layers * self.layer_weights + self.vocab * self.hidden


def prefill_flops(shape: Shape, tokens: int, logits_tokens: int = 1) -> int:
    """One prompt of ``tokens`` tokens, causal, with logits for its last ``logits_tokens``."""
    linear = 2 * tokens * shape.layers * shape.layer_weights + 2 * logits_tokens * shape.vocab * shape.hidden
    # token i attends to i+1 positions: scores (q.k) and weighted sum (p.v), 2 FLOPs each per element
    attended = tokens * (tokens + 1) // 2
    attention = shape.layers * 2 * 2 * shape.heads * shape.head_dim * attended
    return linear + attention


def decode_flops(shape: Shape, batch: int, context: int) -> int:
    """One decode step: ``batch`` requests, each attending over ``context`` positions."""
    linear = 2 * batch * shape.linear_weights
    attention = batch * shape.layers * 2 * 2 * shape.heads * shape.head_dim * context
    return linear + attention


def decode_bytes(shape: Shape, batch: int, context: int, dtype_bytes: int = 4, weight_bytes: int | None = None) -> int:
    """Bytes one decode step must read: the weights once, each request's K and V over its context.
    ``weight_bytes``: the layers' projections in another precision than the KV cache and the LM
    head (``--cpu-linear bf16``: 2 against 4)."""
    kv = batch * shape.layers * 2 * shape.kv_heads * shape.head_dim * context
    proj = shape.layers * shape.layer_weights
    return (dtype_bytes if weight_bytes is None else weight_bytes) * proj + dtype_bytes * (shape.linear_weights - proj + kv)


def roofline_s(flops: int, nbytes: int, peak_flops: float, bandwidth: float) -> float:
    """The roofline's lower bound on a step's time: max(bytes / bandwidth, FLOPs / peak)."""
    return max(nbytes / bandwidth, flops / peak_flops)
