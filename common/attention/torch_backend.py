"""Reference attention on plain torch ops: runs on CPU and GPU, and is the oracle the
flashinfer backend is checked against.

EXTEND and DECODE share one path: requests are padded into a few groups and each group is one
``scaled_dot_product_attention`` call per layer (DECODE is EXTEND with one new token each).
``init_forward_metadata`` plans the groups once per batch; every layer reuses the plan::

    extend, one group: prefix_lens=[2, 0], extend_lens=[2, 3]   (packed tokens: a2 a3 | b0 b1 b2)
        KV slots  [[a0 a1 a2 a3 0 ]      queries  [[a2 a3 a2]      mask (query row x key)
                   [b0 b1 b2 0  0 ]]               [b0 b1 b2]]     a2: 1 1 1 0 0   b0: 1 0 0 0 0
                                                                    a3: 1 1 1 1 0   b1: 1 1 0 0 0
                                                                   pad: 1 0 0 0 0   b2: 1 1 1 0 0

Padded keys read slot 0 (the reserved page) and are masked out; a padded query row repeats the
request's first token, attends only key 0 (a fully masked row could give NaN) and is dropped.
Groups keep padding bounded: requests are taken longest first and a new group starts once the
padded score matrix would be over 1.5x the real one (and not tiny), so one 2048-token chunk does not
pad fifty short prompts to its length.

K/V are gathered with ``index_select`` (a row copy; advanced indexing ``buf[slots]`` measured
~10x slower on CPU) and GQA is left to SDPA (``enable_gqa``), which skips materialising the
repeated heads; both give the same numbers as the per-request loop they replace.

DECODE batches skip the gather: ``decode_mirror.py`` keeps each decoding request's K/V
contiguous across steps and attention reads it in place (the same keys and values; in float32
on CPU our C++ kernel, ``common/kernels``, or where it is not built two batched matmuls instead of
SDPA; each equal to SDPA up to rounding). The gather path stays for
EXTEND, for tables the runner did not build, and for the requests of a batch the mirror's memory
budget does not cover: the longest are left out first (``_PartlyMirrored``), the rest keep their lanes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import kernels
from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.attention.decode_mirror import DecodeMirror, MirrorPlan
from common.engine.forward_batch import ForwardBatch, ForwardMode

# A group grows while its padded score matrix is at most PAD_RATIO x the real one, or exceeds it
# by at most PAD_FLOOR elements (small batches: padding is cheaper than another call).
PAD_RATIO = 1.5
PAD_FLOOR = 1 << 12
# Causal attention on CPU runs ATTN_BLOCK query rows per flash call (``_blocked_attention``): the
# block's own keys causally, the keys before it in one unmasked call, merged by their log-sum-exps.
# SDPA's CPU flash kernel is slowest on long causal squares (64-row blocks: 4.4 against 6.5-6.9 ms
# a layer for a 512-token prompt on SmolLM2's shape, 44 against 57 ms for 1024 new tokens after
# 1024 cached; BENCHMARKS), and a mask makes it read every block above the diagonal.
ATTN_BLOCK = 64


@dataclass
class _PartlyMirrored:
    """A decode batch the mirror holds only part of (``DecodeMirror.plan_within_budget``): the
    mirrored requests' plan and batch indices, and groups for the rest, which attend from the pages."""

    plan: MirrorPlan
    mirrored: torch.Tensor  # [M] int64 batch index of each of the plan's rows
    groups: list[_Group]


@dataclass
class _Group:
    num_reqs: int
    max_ext: int
    max_seq: int
    slots: torch.Tensor  # [G * S] int64 KV slots, request-major, padded with slot 0
    mask: torch.Tensor | None  # [G, 1, E, S] bool, True where a query row attends a key; None: causal
    q_index: torch.Tensor | None  # [G * E] int64 packed-token index of each query row; None: q is already [G*E]
    keep: torch.Tensor | None  # [n] int64 real rows among the G * E; None: all are real
    out_index: torch.Tensor | None  # [n] int64 packed-token index of each kept row; None: the whole batch in order
    blocked_prefix: int | None = None  # not None: causal after this many cached keys, in blocks (ATTN_BLOCK)
    causal_prefix: int | None = None  # not None: every row causal after this many cached keys (one request, or a square)


def plan_groups(ext: Sequence[int], seq: Sequence[int]) -> list[list[int]]:
    """Partition request indices into groups padded together (each group in batch order)."""
    order = sorted(range(len(ext)), key=lambda i: (-ext[i], -seq[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    e_max = s_max = real = 0
    for i in order:
        e2, s2, r2 = max(e_max, ext[i]), max(s_max, seq[i]), real + ext[i] * seq[i]
        padded = (len(cur) + 1) * e2 * s2
        if cur and padded > PAD_RATIO * r2 and padded - r2 > PAD_FLOOR:
            groups.append(sorted(cur))
            cur, e2, s2, r2 = [], ext[i], seq[i], ext[i] * seq[i]
        cur.append(i)
        e_max, s_max, real = e2, s2, r2
    if cur:
        groups.append(sorted(cur))
    return groups


def _plan_group(members: list[int], batch: ForwardBatch, starts: list[int], whole: bool) -> _Group:
    """Index tensors of one group (built on the host, moved to the device once per batch)."""
    dev = batch.req_to_token.device
    ext_l = [batch.extend_lens_cpu[i] for i in members]
    pre_l = [batch.prefix_lens_cpu[i] for i in members]
    pre, ext, start = torch.tensor([pre_l, ext_l, [starts[i] for i in members]])  # [G] each
    seq = pre + ext  # [G]
    e, s = max(ext_l), max(p + x for p, x in zip(pre_l, ext_l))
    kpos = torch.arange(s)  # [S] key position
    valid = kpos[None, :] < seq[:, None]  # [G, S] keys that exist
    if e == 1:  # decode (or one-token chunks): the only query sees every key there is
        mask, q_rows, keep = valid[:, None, :], start, None  # [G, 1, S], [G]
    else:
        j = torch.arange(e)  # [E] query row within its request
        real = j[None, :] < ext[:, None]  # [G, E]
        # query j of a request sits at position prefix + j and sees keys 0 .. prefix + j
        causal = kpos[None, None, :] <= (pre[:, None] + j[None, :])[:, :, None]  # [G, E, S]
        mask = torch.where(real[:, :, None], causal, kpos[None, None, :] == 0)  # [G, E, S]
        q_rows = torch.where(real, start[:, None] + j[None, :], start[:, None]).reshape(-1)  # [G * E]
        keep = None if bool(real.all()) else real.reshape(-1).nonzero().squeeze(1)  # [n]
    # No cached prefix anywhere: query j sits at position j, so plain causal attention (which lets
    # SDPA skip the blocks above the diagonal) is the mask; real rows never reach a padded key.
    square = e > 1 and max(pre_l) == 0
    # In query blocks (CPU): a causal square (any number of requests: a real row never reaches a
    # padded key), or one request past its cached prefix; not several with different prefixes.
    causal = e > 1 and (square or len(members) == 1)
    blocked = e > ATTN_BLOCK and dev.type == "cpu" and causal
    rows = batch.req_pool_indices if whole else batch.req_pool_indices[torch.tensor(members, device=dev)]  # [G]
    slots = batch.req_to_token.index_select(0, rows)[:, :s].long()  # [G, S]
    slots = slots.masked_fill_(~valid.to(dev), 0)  # padding reads the reserved page
    return _Group(
        num_reqs=len(members), max_ext=e, max_seq=s,
        slots=slots.reshape(-1),
        mask=None if square else mask[:, None, :, :].to(dev),
        q_index=None if (whole and keep is None) else q_rows.to(dev),  # whole and dense: q is already [G*E]
        keep=None if keep is None else keep.to(dev),
        out_index=None if whole else (q_rows if keep is None else q_rows[keep]).to(dev),
        blocked_prefix=pre_l[0] if blocked else None,
        causal_prefix=pre_l[0] if causal else None,
    )


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, decode_mirror_bytes: int = 0, cpu: bool = True) -> None:
        """``decode_mirror_bytes``: memory the decode mirror may hold; 0 turns it off. ``cpu``: the
        model runs on the CPU, where float32 decode over the mirror runs our C++ kernel."""
        # None: not on CPU, no mirror, or the kernel did not build (torch ops then).
        self.native_decode = kernels.decode_attention() if decode_mirror_bytes > 0 and cpu else None
        # Keys in the kernel's fast layout where it reads them.
        self.mirror = (DecodeMirror(decode_mirror_bytes, blocked_keys=self.native_decode is not None)
                       if decode_mirror_bytes > 0 else None)
        # Causal prefill and extend on CPU in float32 (SDPA where it did not build, or elsewhere).
        self.native_prefill = kernels.prefill_attention() if cpu else None

    def reset(self) -> None:
        if self.mirror is not None:
            self.mirror.reset()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ext, seq = batch.extend_lens_cpu, batch.seq_lens_cpu
        planned = None
        if self.mirror is not None and batch.mode is ForwardMode.DECODE and len(batch.rows_cpu) == batch.batch_size:
            planned = self.mirror.plan_within_budget(batch)
            if planned is not None and len(planned[1]) == len(seq):
                batch.attn_metadata = planned[0]  # the usual decode step: wholly mirrored
                return
        starts = [0] * len(ext)
        for i in range(1, len(ext)):
            starts[i] = starts[i - 1] + ext[i - 1]
        if planned is not None:
            plan, mirrored = planned
            held = set(mirrored)
            rest = [i for i in range(len(seq)) if i not in held]
            groups = [[rest[j] for j in g] for g in plan_groups([ext[i] for i in rest], [seq[i] for i in rest])]
            batch.attn_metadata = _PartlyMirrored(
                plan, torch.tensor(mirrored, dtype=torch.int64, device=batch.req_pool_indices.device),
                [_plan_group(g, batch, starts, False) for g in groups])
            return
        groups = plan_groups(ext, seq)
        whole = len(groups) == 1
        batch.attn_metadata = [_plan_group(g, batch, starts, whole) for g in groups]

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
        if isinstance(batch.attn_metadata, MirrorPlan):
            return self._decode_mirrored(q, k, v, k_buf, v_buf, layer, batch.attn_metadata)
        if isinstance(batch.attn_metadata, _PartlyMirrored):
            part = batch.attn_metadata
            out = torch.empty_like(q)  # [B, heads, head_dim]
            m = part.mirrored
            held = self._decode_mirrored(q.index_select(0, m), k.index_select(0, m), v.index_select(0, m), k_buf,
                                         v_buf, layer, part.plan)
            out.index_copy_(0, m, held.view(-1, hq, d))
            self._groups_into(out, q, k_buf, v_buf, layer, part.groups)
            return out.reshape(-1, hq * d)
        groups: list[_Group] = batch.attn_metadata
        if len(groups) == 1:
            out = self._group(q, k_buf, v_buf, layer, groups[0])
        else:
            out = torch.empty_like(q)  # [T, heads, head_dim]
            self._groups_into(out, q, k_buf, v_buf, layer, groups)
        return out.reshape(-1, hq * d)

    def _groups_into(self, out: torch.Tensor, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     layer: AttentionLayerSpec, groups: list[_Group]) -> None:
        """Each group's attention into its rows of ``out`` [T, heads, head_dim]."""
        for g in groups:
            assert g.out_index is not None
            out.index_copy_(0, g.out_index, self._group(q, k_buf, v_buf, layer, g))

    def _decode_mirrored(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                         v_buf: torch.Tensor, layer: AttentionLayerSpec, plan: MirrorPlan) -> torch.Tensor:
        """One query per request against its mirrored lane. [B, heads * head_dim]"""
        assert self.mirror is not None
        hq, d = layer.num_heads, layer.head_dim
        keys_t, vals = self.mirror.layer_kv(layer.layer_id, plan, k_buf, v_buf, k, v)  # [B, kv_heads, d, S] | None, [B, kv_heads, S, d]
        ql = q if plan.to_lane is None else q.index_select(0, plan.to_lane)  # [B, heads, head_dim], lane order
        whole_k, whole_v = self.mirror.whole(layer.layer_id)
        if self.native_decode is not None and self.native_decode.supports(ql, whole_k):
            out = self.native_decode(ql, whole_k, whole_v, plan.lane_lens, plan.num_lanes, layer.scaling)
        else:
            if keys_t is None:  # keys blocked for the kernel, which declined this layer: a plain copy
                keys_t = self.mirror.plain_keys(layer.layer_id, plan.num_lanes, plan.max_seq)
            if q.dtype == torch.float32 and keys_t.dtype == torch.float32:
                out = _one_query_attention(ql, keys_t, vals, layer, plan)
            else:  # half precision: SDPA accumulates in float32, two plain matmuls would not
                out = torch.nn.functional.scaled_dot_product_attention(
                    ql[:, :, None, :], keys_t.transpose(-1, -2).to(q.dtype), vals.to(q.dtype), attn_mask=plan.mask,
                    scale=layer.scaling, enable_gqa=hq != layer.num_kv_heads)  # [B, heads, 1, head_dim]
        out = out.view(-1, hq, d)
        if plan.from_lane is not None:
            out = out.index_select(0, plan.from_lane)  # back to batch order
        return out.reshape(-1, hq * d)

    def _group(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: AttentionLayerSpec,
               g: _Group) -> torch.Tensor:
        """Attention of one group's real query rows. [n, heads, head_dim]"""
        n, e, s = g.num_reqs, g.max_ext, g.max_seq
        hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        keys = k_buf.index_select(0, g.slots).view(n, s, hk, d).to(q.dtype)  # [G, S, kv_heads, head_dim]
        vals = v_buf.index_select(0, g.slots).view(n, s, hk, d).to(q.dtype)
        qg = q if g.q_index is None else q.index_select(0, g.q_index)  # [G * E, heads, head_dim]
        if (g.causal_prefix is not None and self.native_prefill is not None
                and self.native_prefill.supports(qg, keys)):
            out = self.native_prefill(qg.view(n, e, hq, d), keys, vals, g.causal_prefix, layer.scaling)
            out = out.view(n * e, hq, d)
            return out if g.keep is None else out.index_select(0, g.keep)
        keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)  # [G, kv_heads, S, head_dim]
        qg = qg.view(n, e, hq, d).transpose(1, 2)  # [G, heads, E, head_dim]
        if g.blocked_prefix is not None and qg.dtype == torch.float32:
            out = _blocked_attention(qg, keys, vals, layer, g.blocked_prefix)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, keys, vals, attn_mask=g.mask, is_causal=g.mask is None, scale=layer.scaling,
                enable_gqa=hq != hk)  # [G, heads, E, head_dim]
        out = out.transpose(1, 2).reshape(n * e, hq, d)  # [G * E, heads, head_dim]
        return out if g.keep is None else out.index_select(0, g.keep)


def _one_query_attention(q: torch.Tensor, keys_t: torch.Tensor, vals: torch.Tensor, layer: AttentionLayerSpec,
                         plan: MirrorPlan) -> torch.Tensor:
    """softmax(q K^T * scale + mask) V for one query per lane, as two batched matmuls. [B, heads, 1, head_dim]

    SDPA's CPU kernel is built for blocks of queries; with one query per request it measured
    15-25 % slower than this (float32, 2-8 KV heads, 100-420 keys). Query heads of one KV head
    are the rows of one matmul, so GQA needs no repeated keys. q: [B, heads, head_dim];
    keys_t: [B, kv_heads, head_dim, S] (the mirror keeps keys transposed), vals: [B, kv_heads, S,
    head_dim] (views into the mirror)."""
    b, hk, d, s = keys_t.shape
    group = layer.num_heads // hk
    scores = torch.matmul(q.view(b, hk, group, d), keys_t).mul_(layer.scaling)  # [B, kv_heads, G, S]
    if plan.mask is not None:
        if plan.bias is None:
            plan.bias = torch.zeros(plan.mask.shape, dtype=torch.float32, device=q.device).masked_fill_(
                ~plan.mask, float("-inf"))  # [B, 1, 1, S]
        scores.add_(plan.bias)
    return torch.matmul(torch.softmax(scores, dim=-1), vals).view(b, layer.num_heads, 1, d)


def _blocked_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, layer: AttentionLayerSpec,
                       prefix: int) -> torch.Tensor:
    """Causal attention of E new queries after ``prefix`` cached keys, ATTN_BLOCK queries at a
    time, without a mask. [G, heads, E, head_dim]

    The queries of block [s, e) see every key before the block and, causally, the block's own.
    So: one flash call over the earlier keys (no mask), one over the block's keys (``is_causal``,
    square), each returning its softmax's log-sum-exp, and the two partial results weighted by
    ``exp(lse - max)``: the softmax over all the keys, up to float32 rounding. In a padded group
    (no prefixes, uneven lengths) a real query's keys all lie before it, so it never reads padding.
    q: [G, heads, E, head_dim]; keys/vals: [G, kv_heads, prefix + E, head_dim]; the CPU flash op
    takes the fewer KV heads as they are (GQA)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    e_total, scale = q.shape[2], layer.scaling
    out = torch.empty_like(q)
    for s in range(0, e_total, ATTN_BLOCK):
        e, k0 = min(e_total, s + ATTN_BLOCK), prefix + s  # this block's queries; keys before it
        qb = q[:, :, s:e]
        out_b, lse_b = flash(qb, keys[:, :, k0:prefix + e], vals[:, :, k0:prefix + e], 0.0, True, scale=scale)[:2]
        if k0 == 0:
            out[:, :, s:e] = out_b
            continue
        out_p, lse_p = flash(qb, keys[:, :, :k0], vals[:, :, :k0], 0.0, False, scale=scale)[:2]
        top = torch.maximum(lse_p, lse_b)  # [G, heads, rows]
        w_p, w_b = torch.exp(lse_p - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)  # [G, heads, rows, 1]
        torch.div(out_p * w_p + out_b * w_b, w_p + w_b, out=out[:, :, s:e])
    return out
