"""The torch attention backend's batched path against a per-request reference written out here
(float64 softmax over each request's own keys): extend with cached prefixes, decode, GQA,
scattered pages, and batches that split into several padded groups."""
from __future__ import annotations

import sys

import pytest
import torch

from common import kernels
from common.attention import torch_backend
from common.attention.base import AttentionLayerSpec
from common.attention.torch_backend import TorchAttentionBackend, plan_groups
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.kvcache.pool import KVLayout, KVPool

PAGE = 4
HEADS, KV_HEADS, D = 4, 2, 8


def make(prefix: list[int], ext: list[int], seed: int = 0) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch over scattered pages with random cached K/V; returns (batch, q, k, v) of the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=D, page_size=PAGE, dtype="float32")
    pool = KVPool(layout, 400, "cpu")
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen))
    rows = [5 + 2 * i for i in range(len(prefix))]  # not 0..B-1: rows are looked up, not assumed
    table = torch.zeros(2 * len(prefix) + 8, 256, dtype=torch.int32)
    pages = (torch.randperm(399, generator=gen) + 1).tolist()  # page 0 is reserved
    for r, p, n in zip(rows, prefix, ext):
        need = -(-(p + n) // PAGE)
        mine = torch.tensor([pages.pop() for _ in range(need)])
        table[r, : need * PAGE] = (mine[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1).to(torch.int32)
    pos = [q for p, n in zip(prefix, ext) for q in range(p, p + n)]
    tok_rows = [r for r, n in zip(rows, ext) for _ in range(n)]
    seq = [p + n for p, n in zip(prefix, ext)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    mode = ForwardMode.DECODE if all(n == 1 for n in ext) else ForwardMode.EXTEND
    batch = ForwardBatch(mode, t([0] * len(pos)), t(pos), table[t(tok_rows), t(pos)].long(), t(rows), t(seq), t(prefix),
                         t(ext), table, pool, seq, prefix, ext)
    T = len(pos)
    q = torch.randn(T, HEADS * D, generator=gen)
    k = torch.randn(T, KV_HEADS * D, generator=gen)
    v = torch.randn(T, KV_HEADS * D, generator=gen)
    return batch, q, k, v


def reference(batch: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """Per request, per head: softmax over keys 0..prefix+j of the pool (K/V already stored). [T, H*D]"""
    out = []
    start = 0
    k_buf, v_buf = batch.kv_pool.k_buffers[0].double(), batch.kv_pool.v_buffers[0].double()
    for i, (pre, n) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        slots = batch.req_to_token[batch.req_pool_indices[i], : pre + n].long()
        for j in range(n):
            qj = q[start + j].double().view(HEADS, D)
            row = []
            for h in range(HEADS):
                kh = h // (HEADS // KV_HEADS)  # GQA: query head h reads kv head h // group
                keys = k_buf[slots[: pre + j + 1], kh]  # [S, D]
                w = torch.softmax(keys @ qj[h] * D**-0.5, dim=0)
                row.append(w @ v_buf[slots[: pre + j + 1], kh])
            out.append(torch.cat(row))
        start += n
    return torch.stack(out).float()


def run(batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    backend = TorchAttentionBackend()
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, AttentionLayerSpec(0, HEADS, KV_HEADS, D, D**-0.5), batch)


@pytest.mark.parametrize(("prefix", "ext"), [
    ([0, 5, 0, 13], [7, 1, 3, 20]),  # extend: cached prefixes, uneven lengths (padded rows and keys)
    ([0, 0, 0], [6, 6, 6]),  # extend: equal lengths, no padding at all (plain causal)
    ([0, 0, 0], [9, 2, 5]),  # extend: nothing cached, uneven (plain causal over padded rows)
    ([3, 17, 64, 0, 1], [1, 1, 1, 1, 1]),  # decode
    ([0], [1]),  # one token, nothing cached
])
def test_batched_attention_equals_the_per_request_reference(prefix: list[int], ext: list[int]) -> None:
    batch, q, k, v = make(prefix, ext)
    got = run(batch, q, k, v)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(batch, q), rtol=1e-5, atol=1e-5)


def test_several_groups_give_the_same_result_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, ext = [0, 40, 2, 0, 100], [60, 1, 3, 2, 30]
    monkeypatch.setattr(torch_backend, "PAD_FLOOR", 1 << 30)  # any padding: one group
    batch, q, k, v = make(prefix, ext, seed=3)
    one = run(batch, q, k, v)
    assert len(batch.attn_metadata) == 1
    monkeypatch.setattr(torch_backend, "PAD_FLOOR", 0)  # no padding beyond the real scores: many
    monkeypatch.setattr(torch_backend, "PAD_RATIO", 1.0)
    batch, q, k, v = make(prefix, ext, seed=3)
    many = run(batch, q, k, v)
    assert len(batch.attn_metadata) > 2
    torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(many, reference(batch, q), rtol=1e-5, atol=1e-5)


def test_grouping_keeps_a_long_chunk_from_padding_short_prompts() -> None:
    assert plan_groups([2048] + [20] * 50, [2048] + [20] * 50) == [[0], list(range(1, 51))]
    assert plan_groups([128] * 32, [128] * 32) == [list(range(32))]  # equal prompts: one call
    assert plan_groups([], []) == []
    seq = [100, 3000, 120, 90, 2900, 110, 95, 105, 2000]  # decode: one new token each
    groups = plan_groups([1] * len(seq), seq)
    assert sorted(i for g in groups for i in g) == list(range(len(seq)))
    for g in groups:  # within each group, padding stays bounded
        padded, real = len(g) * max(seq[i] for i in g), sum(seq[i] for i in g)
        assert padded <= torch_backend.PAD_RATIO * real or padded - real <= torch_backend.PAD_FLOOR
    assert len(groups) < len(seq)  # and short requests still share calls


@pytest.mark.parametrize(("prefix", "ext", "blocked"), [
    ([13], [20], True),  # one request past its prefix, 5 blocks of 4 queries
    ([40], [9], True),  # the last block short
    ([5], [1], False),  # one new token: a single query needs no blocks
    ([0, 0, 0], [9, 2, 5], True),  # a padded causal square: several requests, nothing cached
    ([0], [4], False),  # one block's worth: plain causal
    ([6, 3], [10, 8], False),  # several requests with prefixes: the masked SDPA
])
def test_blocked_causal_attention_equals_the_reference_and_the_sdpa_it_replaces(
        monkeypatch: pytest.MonkeyPatch, prefix: list[int], ext: list[int], blocked: bool) -> None:
    """Causal attention ATTN_BLOCK queries at a time (the block's keys causally, earlier keys in
    one unmasked call, merged by log-sum-exps) gives the per-request softmax, and agrees with the
    single SDPA call it replaces."""
    monkeypatch.setattr(torch_backend, "ATTN_BLOCK", 4)
    monkeypatch.setattr(torch_backend, "PAD_FLOOR", 1 << 30)  # several requests: one group
    batch, q, k, v = make(prefix, ext, seed=5)
    got = run(batch, q, k, v)
    (group,) = batch.attn_metadata
    assert group.blocked_prefix == (prefix[0] if blocked else None)
    torch.testing.assert_close(got, reference(batch, q), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(torch_backend, "ATTN_BLOCK", 1 << 30)
    batch, q, k, v = make(prefix, ext, seed=5)
    whole = run(batch, q, k, v)
    assert batch.attn_metadata[0].blocked_prefix is None
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(kernels._compiler() is None, reason="no C++ compiler to build the kernel with")
@pytest.mark.parametrize(("prefix", "ext", "native"), [
    ([13], [70], True),  # one request past its prefix
    ([0, 0, 0], [9, 2, 5], True),  # a padded causal square: padded rows dropped, real rows never read padding
    ([0], [4], True),
    ([100], [130], True),
    ([6, 3], [10, 8], False),  # several requests with prefixes: the masked SDPA
    ([3, 17], [1, 1], False),  # decode without a mirror: one query each, SDPA
])
def test_causal_groups_run_the_prefill_kernel_and_equal_the_reference(
        monkeypatch: pytest.MonkeyPatch, prefix: list[int], ext: list[int], native: bool) -> None:
    """With head_dim in whole vectors (16), a causal group (one request, or a square) runs the C++
    prefill kernel; it and the SDPA paths give the per-request softmax."""
    monkeypatch.setattr(sys.modules[__name__], "D", 16)
    monkeypatch.setattr(torch_backend, "PAD_FLOOR", 1 << 30)  # several requests: one group
    calls: list[int] = []
    real = kernels.PrefillAttention.__call__
    monkeypatch.setattr(kernels.PrefillAttention, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    batch, q, k, v = make(prefix, ext, seed=7)
    got = run(batch, q, k, v)
    assert bool(calls) == native
    torch.testing.assert_close(got, reference(batch, q), rtol=1e-5, atol=1e-5)
