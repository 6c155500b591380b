"""FlashInfer attention over the paged KV pool (CUDA only; flashinfer is imported lazily).

Our K/V buffer ``[num_pages * page_size, kv_heads, head_dim]`` is exactly FlashInfer's "NHD"
paged layout ``[num_pages, page_size, kv_heads, head_dim]`` viewed without a copy. A request's
page table is read off its req->token row: the slot of every ``page_size``-th position divided
by ``page_size`` (CSR form: ``indptr`` delimits each request's run of ``indices``)::

    row slots:  [48 49 50 51 | 12 13 14 15 | 80 81]   page_size 4, seq_len 10
    pages:      [12, 3, 20]   last_page_len 2

One plan per batch is shared by every layer. Extend batches use the paged prefill wrapper with
``causal=True``: FlashInfer aligns each request's queries to the end of its KV, which is exactly
"query j at position prefix+j sees keys 0..prefix+j". Decode uses the decode wrapper with tensor
cores (GQA groups fill the MMA rows). Both are pinned to the FA2 kernels: they serve every
architecture from Ampere on, and one JIT module (per dtype and head_dim) then covers prefill and
decode alike, where ``auto`` could pick FA3 or cuDNN paths that each compile or load separately.

CUDA graphs (common/engine/cuda_graph.py) get one decode wrapper per captured batch size, all
over shared metadata buffers sized for the largest: the captured kernels read those addresses, and
``plan_decode_graph`` rewrites their contents (host-side planning, outside the graph) before each
replay.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.engine.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 256 * 1024 * 1024
KERNELS = "fa2"


def paged_kv_metadata(seq_lens: Sequence[int], rows: torch.Tensor, table: torch.Tensor,
                      page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR page tables of a batch without a device sync.

    ``seq_lens``: each request's KV length (host ints); ``rows``: their req->token rows ([B] on
    the table's device). Returns ``indptr`` [B+1] and ``last_page_len`` [B] (int32, on the host:
    FlashInfer plans on the host) and ``indices`` [indptr[-1]] (int32, on the table's device),
    gathered from the table with index tensors whose size is known on the host, so no
    boolean-mask indexing (a sync) is needed. The host arithmetic is numpy: a decode step runs it
    before every replay, and torch's per-op overhead on CPU tensors made it 4-6x slower."""
    seq = np.asarray(seq_lens, dtype=np.int64)  # [B]
    pages = (seq + page_size - 1) // page_size  # [B]
    indptr = np.zeros(len(seq) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    owner = np.repeat(np.arange(len(seq)), pages)  # [P] request of each page entry
    nth = np.arange(indptr[-1]) - indptr[:-1][owner]  # [P] page number within its request
    where = torch.from_numpy(np.stack([owner, nth * page_size])).to(table.device, non_blocking=True)  # [2, P], one copy
    indices = (table[rows[where[0]], where[1]] // page_size).to(torch.int32)  # [P]
    last = torch.from_numpy((seq - (pages - 1) * page_size).astype(np.int32))  # [B]
    return torch.from_numpy(indptr.astype(np.int32)), indices, last


@dataclass
class _Plan:
    wrapper: Any  # the FlashInfer wrapper this batch runs with
    indptr: torch.Tensor  # [B+1] int32, host
    indices: torch.Tensor  # [pages] int32, device
    last_page_len: torch.Tensor  # [B] int32, host
    qo_indptr: torch.Tensor | None = None  # [B+1] int32, host (extend only)
    planned_for: tuple[int, int, int, float] | None = None  # (heads, kv_heads, head_dim, scale)


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, device: str | torch.device) -> None:
        import flashinfer  # lazy: absent on CPU machines

        self._fi = flashinfer
        self.device = torch.device(device)
        # FlashInfer asks for a zeroed float workspace before its first use.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=KERNELS)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True,
                                                                    backend=KERNELS)
        self._graph: dict[int, Any] = {}  # captured batch size -> its decode wrapper
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # -- eager ----------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ps = batch.kv_pool.page_size
        indptr, indices, last = paged_kv_metadata(batch.seq_lens_cpu, batch.req_pool_indices, batch.req_to_token, ps)
        if batch.mode is ForwardMode.EXTEND:
            qo = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), dim=0, out=qo[1:])
            batch.attn_metadata = _Plan(self.prefill, indptr, indices, last, qo_indptr=qo)
        else:
            batch.attn_metadata = _Plan(self.decode, indptr, indices, last)

    def _plan(self, plan: _Plan, layer: AttentionLayerSpec, page_size: int, q_dtype: torch.dtype,
              kv_dtype: torch.dtype) -> None:
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
        if plan.planned_for == key:
            return
        common = dict(sm_scale=layer.scaling, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if plan.qo_indptr is not None:
            plan.wrapper.plan(plan.qo_indptr, plan.indptr, plan.indices, plan.last_page_len,
                              layer.num_heads, layer.num_kv_heads, layer.head_dim, page_size, causal=True, **common)
        else:
            plan.wrapper.plan(plan.indptr, plan.indices, plan.last_page_len,
                              layer.num_heads, layer.num_kv_heads, layer.head_dim, page_size,
                              pos_encoding_mode="NONE", **common)
        plan.planned_for = key

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(-1, hk, d), v.view(-1, hk, d))
        plan: _Plan = batch.attn_metadata
        # Planned at the first layer (every layer shares the shape); a graph's plan is made before
        # capture and replay, so nothing here runs on the host inside a captured forward.
        self._plan(plan, layer, pool.page_size, q.dtype, pool.k_buffers[0].dtype)
        ps = pool.page_size
        k_cache = pool.k_buffers[layer.layer_id].view(-1, ps, hk, d)  # [pages, page_size, kv_heads, head_dim]
        v_cache = pool.v_buffers[layer.layer_id].view(-1, ps, hk, d)
        out = plan.wrapper.run(q.view(-1, hq, d), (k_cache, v_cache))  # [T, heads, head_dim]
        return out.reshape(-1, hq * d)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def init_cuda_graphs(self, batch_sizes: Sequence[int], max_pages_per_req: int) -> None:
        """One decode wrapper per captured batch size, over metadata buffers for the largest."""
        most = max(batch_sizes)
        i32 = dict(dtype=torch.int32, device=self.device)
        indptr, indices, last = (torch.zeros(most + 1, **i32), torch.zeros(most * max_pages_per_req, **i32),
                                 torch.zeros(most, **i32))
        self._graph_bufs = (indptr, indices, last)
        for bs in batch_sizes:
            self._graph[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend=KERNELS,
                paged_kv_indptr_buffer=indptr[: bs + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:bs])

    def plan_decode_graph(self, bs: int, rows: torch.Tensor, seq_lens: Sequence[int], table: torch.Tensor,
                          layer: AttentionLayerSpec, kv_pool: Any, q_dtype: torch.dtype) -> _Plan:
        """Plan the captured size ``bs`` for these rows (padded entries included); returns the
        metadata its forward reads. Runs on the host, before capture and before every replay."""
        indptr, indices, last = paged_kv_metadata(seq_lens, rows, table, kv_pool.page_size)
        plan = _Plan(self._graph[bs], indptr, indices, last)
        self._plan(plan, layer, kv_pool.page_size, q_dtype, kv_pool.k_buffers[0].dtype)
        return plan
