"""The layers' small ops on the torch path, bit for bit against HF transformers' own modules.

The CPU path trades HF's formulas for fewer calls (``torch.rms_norm``, one normalization for the
q and k heads of a fused projection, RoPE's sign folded into sin); each is claimed to give the
same bits. These tests hold that claim on the pinned torch, so a torch upgrade that changes one
of those kernels fails here, by name, before any greedy-token test has to notice.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from common.models import ops
from common.models.arch import RopeConfig
from common.models.rope import Rope, RotaryEmbedding

DTYPES = (torch.float32, torch.bfloat16)


def hf_norm(cls: type, weight: torch.Tensor, eps: float) -> torch.nn.Module:
    norm = cls(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (33, 64), (300, 9, 64), (5, 4, 32)])
def test_rms_norm_is_hf_to_the_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    want = hf_norm(LlamaRMSNorm, w, 1e-5)(x)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(7, 128, generator=g).to(dtype), torch.randn(7, 128, generator=g).to(dtype)
    w = torch.randn(128, generator=g).to(dtype)
    normed, total = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, res + x)
    assert torch.equal(normed, hf_norm(Qwen3RMSNorm, w, 1e-6)(res + x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_q_and_k_heads_normed_together_equal_hf_norming_each(dtype: torch.dtype) -> None:
    """Qwen3: q_norm over the query heads and k_norm over the KV heads, here as one strided view
    of the fused projection's output (the layout Attention hands in)."""
    t, hq, hk, d = 6, 4, 2, 32
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    wq, wk = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)
    got = ops.rms_norm_heads(qk, ((hq, wq), (hk, wk)), 1e-6)
    want_q = hf_norm(Qwen3RMSNorm, wq, 1e-6)(qkv[:, : hq * d].reshape(t, hq, d))
    want_k = hf_norm(Qwen3RMSNorm, wk, 1e-6)(qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d))
    assert torch.equal(got[:, :hq], want_q) and torch.equal(got[:, hq:], want_k)
    assert torch.equal(qkv[:, : (hq + hk) * d].view(t, hq + hk, d), qk)  # the input is left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [RopeConfig(10000.0), RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 256)])
def test_rope_is_hf_rotate_half_to_the_bit(dtype: torch.dtype, rope: RopeConfig) -> None:
    t, hq, hk, d = 9, 6, 2, 64
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hk, d, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 4095, 3, 60000])
    rot = RotaryEmbedding(rope, d)
    cos, sin = rot.cos_sin(positions, dtype)  # [T, 1, d]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    r = rot.prepare(positions, dtype)
    got_q, got_k = r.apply(q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    both = r.rotate(torch.cat((q, k), dim=1))  # q and k heads side by side, as the layers rotate them
    assert torch.equal(both[:, :hq], want_q) and torch.equal(both[:, hq:], want_k)
    assert isinstance(r, Rope) and r.kernels is None
