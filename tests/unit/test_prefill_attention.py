"""The prefill-attention kernel (common/kernels/prefill_attention.cpp) against a float64 softmax,
and the torch backend's causal groups running it."""
from __future__ import annotations

import pytest
import torch

from common import kernels

needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C++ compiler to build the kernel with")


@pytest.fixture(scope="module")
def kernel() -> kernels.PrefillAttention:
    k = kernels.prefill_attention()
    assert k is not None
    return k


def reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """Token t of each request sees keys 0 .. prefix + t; query head h reads KV head h // group. float64."""
    g, e, heads, dim = q.shape
    group = heads // keys.shape[2]
    k64 = keys.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [G, heads, S, D]
    v64 = vals.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    scores = q.double().permute(0, 2, 1, 3) @ k64.transpose(-1, -2) * scale  # [G, heads, E, S]
    pos = prefix + torch.arange(e)
    scores = scores.masked_fill(torch.arange(prefix + e)[None, :] > pos[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v64).permute(0, 2, 1, 3).float()  # [G, E, heads, D]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (2, 1, 128), (6, 3, 80)])
@pytest.mark.parametrize("groups,new,prefix", [
    (1, 1, 0), (1, 5, 0), (1, 32, 0), (1, 33, 0), (1, 64, 0), (1, 65, 7),  # around the 32-token and 64-key blocks
    (1, 130, 100), (2, 40, 0), (3, 70, 0), (1, 3, 190),
])
def test_kernel_matches_a_float64_causal_softmax(kernel: kernels.PrefillAttention, monkeypatch: pytest.MonkeyPatch,
                                                 threads: int, heads: int, kv_heads: int, dim: int, groups: int,
                                                 new: int, prefix: int) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(heads * 1000 + new * 10 + prefix)
    q = torch.randn(groups, new, heads, dim, generator=gen)
    keys = torch.randn(groups, prefix + new, kv_heads, dim, generator=gen)
    vals = torch.randn(groups, prefix + new, kv_heads, dim, generator=gen)
    got = kernel(q, keys, vals, prefix, dim**-0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(q, keys, vals, prefix, dim**-0.5), rtol=2e-5, atol=2e-5)


@needs_compiler
def test_strided_inputs_and_sharp_scores(kernel: kernels.PrefillAttention) -> None:
    """Views are made contiguous; a softmax saturated by scores in the thousands stays finite and
    picks the best key (the running max moves by hundreds between key blocks)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 100, 2, 16, generator=gen)
    keys = torch.randn(1, 100, 1, 32, generator=gen)[..., ::2]  # strided last dim
    vals = torch.randn(1, 100, 1, 16, generator=gen)
    got = kernel(q, keys, vals, 0, 1.0)
    torch.testing.assert_close(got, reference(q, keys.contiguous(), vals, 0, 1.0), rtol=2e-5, atol=2e-5)
    sharp = kernel(q * 300.0, keys, vals, 0, 1.0)
    assert torch.isfinite(sharp).all()
    # scores near 10^3 carry float32 rounding of ~10^-4 into the exponent: a looser bound
    torch.testing.assert_close(sharp, reference(q * 300.0, keys.contiguous(), vals, 0, 1.0), rtol=1e-3, atol=1e-3)


def test_supports_only_float32_cpu_whole_vectors() -> None:
    q, k = torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 2, 64)
    assert kernels.PrefillAttention.supports(q, k)
    assert not kernels.PrefillAttention.supports(q.bfloat16(), k.bfloat16())
    assert not kernels.PrefillAttention.supports(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 2, 8))
