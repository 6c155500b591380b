"""The fused FlashInfer ops (common/models/ops.py, the fused RoPE in rope.py) against the torch
ops they replace, on CUDA in bfloat16, on fresh random inputs (non-contiguous views where the
layers pass them). Skipped without CUDA or flashinfer."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.models import ops  # noqa: E402
from common.models.arch import RopeConfig  # noqa: E402
from common.models.rope import Rope, RotaryEmbedding  # noqa: E402

DEV = "cuda"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "fused", lambda x: None)


@pytest.mark.parametrize("shape", [(1, 1024), (37, 1024), (300, 16, 128)])
def test_rms_norm(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.fused(torch.zeros(1, device=DEV)) is not None
    x = torch.randn(shape, device=DEV, dtype=torch.bfloat16) * 3
    w = torch.rand(shape[-1], device=DEV, dtype=torch.bfloat16) + 0.5
    got = ops.rms_norm(x, w, 1e-6)
    torch_only(monkeypatch)
    want = ops.rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and rel_err(got, want) < 1e-2


def test_add_rms_norm_updates_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(45, 1024, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(45, 1024, device=DEV, dtype=torch.bfloat16) * 4
    w = torch.rand(1024, device=DEV, dtype=torch.bfloat16) + 0.5
    normed, summed = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    torch_only(monkeypatch)
    want_n, want_s = ops.add_rms_norm(x, res, w, 1e-6)
    assert rel_err(summed, want_s) < 1e-2 and rel_err(normed, want_n) < 1e-2


def test_silu_mul(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up = torch.randn(29, 2 * 3072, device=DEV, dtype=torch.bfloat16) * 2
    got = ops.silu_mul(gate_up)
    torch_only(monkeypatch)
    assert got.shape == (29, 3072) and rel_err(got, ops.silu_mul(gate_up)) < 1e-2


@pytest.mark.parametrize("rope_cfg", [RopeConfig(theta=1e6), RopeConfig(theta=5e5, rope_type="llama3", factor=32.0,
                                      low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)])
def test_fused_rope_on_qkv_views(rope_cfg: RopeConfig) -> None:
    heads, kv_heads, d, t = 16, 8, 128, 57
    rot = RotaryEmbedding(rope_cfg, d).to(DEV)
    rot.reserve(4096)
    assert rot.table is not None
    positions = torch.randint(0, 4096, (t,), device=DEV)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : heads * d].reshape(t, heads, d)  # views into qkv, as the layers pass them
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(t, kv_heads, d)
    cos, sin = rot.cos_sin(positions, torch.bfloat16)
    want_q, want_k = Rope(cos=cos, sin=sin).apply(q.clone(), k.clone())
    got_q, got_k = rot.prepare(positions, torch.bfloat16).apply(q, k)
    assert rel_err(got_q, want_q) < 1e-2 and rel_err(got_k, want_k) < 1e-2
