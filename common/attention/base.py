"""Attention backend contract.

A backend is created once per model runner. Before each forward the runner calls
``init_forward_metadata(batch)`` (plan once, reuse for every layer); each attention layer then
calls ``forward``, which must

1. store the new keys/values at ``batch.out_cache_loc`` in ``batch.kv_pool`` (layer ``layer.layer_id``),
2. return causal attention of each new query token over its request's whole KV
   (``req_to_token[req, :seq_len]``, i.e. the cached prefix plus the new tokens up to itself).

Shapes: q [T, num_heads * head_dim], k/v [T, num_kv_heads * head_dim]; output [T, num_heads * head_dim].
GQA is the backend's job (num_heads is a multiple of num_kv_heads).

A backend that can run inside a captured CUDA graph (common/engine/cuda_graph.py) sets
``supports_cuda_graph`` and implements ``init_cuda_graphs`` (fixed metadata buffers, once) and
``plan_decode_graph`` (plan one captured batch size on the host, writing only into those buffers).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute whatever all layers share for this batch; store it in batch.attn_metadata."""

    def reset(self) -> None:
        """Forget anything kept across forwards (called after a forward raised midway)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write k/v to the pool, return attention output (see module docstring)."""
