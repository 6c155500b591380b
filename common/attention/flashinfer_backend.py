"""FlashInfer attention over the paged KV pool (CUDA only; imported lazily).

Our K/V buffer ``[num_pages * page_size, kv_heads, head_dim]`` is exactly FlashInfer's "NHD"
paged layout ``[num_pages, page_size, kv_heads, head_dim]`` viewed without a copy. A request's
page table is read off its req->token row: the slot of every ``page_size``-th position divided
by ``page_size``::

    row slots:  [48 49 50 51 | 12 13 14 15 | 80 81]   page_size 4, seq_len 10
    pages:      [12, 3, 20]   last_page_len 2

One plan per batch (``init_forward_metadata``) is shared by every layer. Extend batches use the
paged prefill wrapper with ``causal=True``: FlashInfer aligns each request's queries to the end
of its KV, which is exactly "query j at position prefix+j sees keys 0..prefix+j".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.engine.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 256 * 1024 * 1024


@dataclass
class _Plan:
    qo_indptr: torch.Tensor | None  # [B+1] int32 (extend only)
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [num_pages_used] int32
    last_page_len: torch.Tensor  # [B] int32
    planned_for: tuple[int, int, int, float] | None = None  # (heads, kv_heads, head_dim, scale)


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, device: str | torch.device) -> None:
        import flashinfer  # lazy: absent on CPU machines

        self.device = torch.device(device)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ps = batch.kv_pool.page_size
        seq = batch.seq_lens.to(torch.int32)  # [B]
        num_pages = (seq + ps - 1) // ps  # [B]
        kv_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=self.device)
        kv_indptr[1:] = torch.cumsum(num_pages, dim=0)
        max_pages = max(-(-s // ps) for s in batch.seq_lens_cpu)
        first_slots = batch.req_to_token[batch.req_pool_indices, : max_pages * ps : ps]  # [B, max_pages]
        valid = torch.arange(max_pages, device=self.device)[None, :] < num_pages[:, None]
        kv_indices = (first_slots[valid] // ps).to(torch.int32)  # [sum pages]
        last = seq - (num_pages - 1) * ps  # [B]
        qo = None
        if batch.mode is ForwardMode.EXTEND:
            qo = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=self.device)
            qo[1:] = torch.cumsum(batch.extend_lens.to(torch.int32), dim=0)
        batch.attn_metadata = _Plan(qo, kv_indptr, kv_indices, last.to(torch.int32))

    def _plan(self, plan: _Plan, layer: AttentionLayerSpec, batch: ForwardBatch, q_dtype: torch.dtype) -> None:
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
        if plan.planned_for == key:
            return
        kv_dtype = batch.kv_pool.k_buffers[0].dtype
        ps = batch.kv_pool.page_size
        if batch.mode is ForwardMode.EXTEND:
            self.prefill.plan(
                plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                layer.num_heads, layer.num_kv_heads, layer.head_dim, ps,
                causal=True, sm_scale=layer.scaling, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        else:
            self.decode.plan(
                plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                layer.num_heads, layer.num_kv_heads, layer.head_dim, ps,
                pos_encoding_mode="NONE", sm_scale=layer.scaling, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        plan.planned_for = key

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(-1, hk, d), v.view(-1, hk, d))
        plan: _Plan = batch.attn_metadata
        self._plan(plan, layer, batch, q.dtype)
        ps = batch.kv_pool.page_size
        k_cache = batch.kv_pool.k_buffers[layer.layer_id].view(-1, ps, hk, d)  # [pages, page_size, kv_heads, head_dim]
        v_cache = batch.kv_pool.v_buffers[layer.layer_id].view(-1, ps, hk, d)
        wrapper = self.prefill if batch.mode is ForwardMode.EXTEND else self.decode
        out = wrapper.run(q.view(-1, hq, d), (k_cache, v_cache))  # [T, heads, head_dim]
        return out.reshape(-1, hq * d)
