"""Reference attention on plain torch ops: runs on CPU and GPU, and is the oracle the
flashinfer backend is checked against.

EXTEND loops over requests (each has its own prefix length); DECODE gathers every request's
KV into one padded batch so a decode step is a handful of kernels regardless of batch size::

    decode, B=2, seq_lens=[3, 5]:   slots  [[a0 a1 a2 0  0 ]      mask [[1 1 1 0 0]
                                            [b0 b1 b2 b3 b4]]           [1 1 1 1 1]]
"""
from __future__ import annotations

import torch

from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.engine.forward_batch import ForwardBatch, ForwardMode


class _DecodeMeta:
    def __init__(self, slots: torch.Tensor, mask: torch.Tensor) -> None:
        self.slots = slots  # [B, max_len] int64, padded with slot 0 (reserved page)
        self.mask = mask  # [B, 1, 1, max_len] bool, True where a key is attended


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.DECODE:
            batch.attn_metadata = None
            return
        max_len = max(batch.seq_lens_cpu) if batch.seq_lens_cpu else int(batch.seq_lens.max())
        rows = batch.req_to_token[batch.req_pool_indices, :max_len].long()  # [B, max_len]
        valid = torch.arange(max_len, device=rows.device)[None, :] < batch.seq_lens[:, None]  # [B, max_len]
        slots = torch.where(valid, rows, torch.zeros_like(rows))
        batch.attn_metadata = _DecodeMeta(slots, valid[:, None, None, :])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k = k.view(-1, hk, d)  # [T, kv_heads, head_dim]
        v = v.view(-1, hk, d)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        q = q.view(-1, hq, d)  # [T, heads, head_dim]
        k_buf = batch.kv_pool.k_buffers[layer.layer_id]
        v_buf = batch.kv_pool.v_buffers[layer.layer_id]
        if batch.mode is ForwardMode.DECODE:
            out = self._decode(q, k_buf, v_buf, layer, batch.attn_metadata)
        else:
            out = self._extend(q, k_buf, v_buf, layer, batch)
        return out.reshape(-1, hq * d)

    @staticmethod
    def _decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: AttentionLayerSpec, meta: _DecodeMeta) -> torch.Tensor:
        group = layer.num_heads // layer.num_kv_heads
        keys = k_buf[meta.slots].to(q.dtype)  # [B, S, kv_heads, head_dim]
        vals = v_buf[meta.slots].to(q.dtype)
        keys = keys.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, heads, S, head_dim]
        vals = vals.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        qb = q[:, :, None, :]  # [B, heads, 1, head_dim]
        out = torch.nn.functional.scaled_dot_product_attention(qb, keys, vals, attn_mask=meta.mask, scale=layer.scaling)
        return out[:, :, 0, :]  # [B, heads, head_dim]

    @staticmethod
    def _extend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)  # [T, heads, head_dim]
        start = 0
        for i in range(batch.batch_size):
            ext, pre, seq = batch.extend_lens_cpu[i], batch.prefix_lens_cpu[i], batch.seq_lens_cpu[i]
            slots = batch.req_to_token[batch.req_pool_indices[i], :seq].long()  # [S]
            keys = k_buf[slots].to(q.dtype).permute(1, 0, 2).repeat_interleave(group, dim=0)  # [heads, S, head_dim]
            vals = v_buf[slots].to(q.dtype).permute(1, 0, 2).repeat_interleave(group, dim=0)
            qi = q[start : start + ext].permute(1, 0, 2)  # [heads, E, head_dim]
            # query j sits at position pre + j and sees keys 0 .. pre + j
            key_pos = torch.arange(seq, device=q.device)[None, :]
            q_pos = pre + torch.arange(ext, device=q.device)[:, None]
            mask = key_pos <= q_pos  # [E, S]
            oi = torch.nn.functional.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, scale=layer.scaling)
            out[start : start + ext] = oi.permute(1, 0, 2)
            start += ext
        return out
