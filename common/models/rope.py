"""Rotary position embeddings, "rotate half" (GPT-NeoX) layout as Llama/Qwen checkpoints use.

A head vector is split in two halves that form complex pairs (x[i], x[i + d/2]) rotated by
angle ``position * inv_freq[i]``::

    out[:d/2] = x[:d/2] * cos - x[d/2:] * sin
    out[d/2:] = x[d/2:] * cos + x[:d/2] * sin

cos/sin are computed per forward from the packed positions (float32, one tiny outer product
shared by every layer) instead of a max-length table, so positions are never out of range.

On CUDA with fused kernels (common/models/ops.py) the rotation of q and k is one FlashInfer
kernel, in place, reading a float32 ``cos | sin`` table the runner has the rotary module build
for its context length (``reserve``); the per-forward cos/sin path stays for CPU and as the
reference.
"""
from __future__ import annotations

import math

import torch

from common.models.arch import RopeConfig
from common.models.ops import fused


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair angular frequency. [head_dim // 2] float32"""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim  # [d/2]
    inv_freq = 1.0 / (rope.theta**exponents)  # [d/2]
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 long-context scaling: long wavelengths are slowed by ``factor``, short ones kept,
    and the band in between is interpolated linearly in 1/wavelength.

        wavelength:   short (< ctx/high)   |  medium         |   long (> ctx/low)
        inv_freq:     unchanged            |  blend          |   inv_freq / factor
    """
    assert rope.original_max_position_embeddings is not None
    ctx = float(rope.original_max_position_embeddings)
    low_wavelen = ctx / rope.low_freq_factor
    high_wavelen = ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    # smooth = 0 at the long end of the band (fully scaled), 1 at the short end (unscaled)
    smooth = (ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        # A buffer so .to(device) moves it; not persistent: it is derived, never loaded.
        self.register_buffer("inv_freq", inv_frequencies(rope, head_dim), persistent=False)
        self.table: torch.Tensor | None = None  # [positions, head_dim] float32 cos | sin (fused path)

    def reserve(self, max_positions: int) -> None:
        """Build the fused kernel's table for positions below ``max_positions`` (no-op where the
        torch path runs)."""
        if fused(self.inv_freq) is None:
            return
        freqs = torch.arange(max_positions, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq[None, :]
        self.table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, d]

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """What every layer's ``Rope.apply`` needs for this forward's packed positions [T]."""
        fi = fused(positions)
        if fi is not None and self.table is not None:
            return Rope(positions=positions, table=self.table, kernels=fi)
        cos, sin = self.cos_sin(positions, dtype)
        return Rope(cos=cos, sin=sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim] in ``dtype`` (broadcast over heads)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin_signed [T, 1, head_dim] -> rotated x, same shape and dtype.

    ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half's first half moved into sin
    (``signed_sin``): a negation is exact, so these are the same bits, and the swap of halves is
    one ``roll`` instead of two slices, a negation and a ``cat``."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., d] -> (-sin[:d/2] | sin[d/2:]), what ``apply_rope`` multiplies the swapped halves by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Rope:
    """One forward's rotary inputs: cos/sin [T, 1, head_dim] (torch) or positions and the table
    (fused, in place)."""

    def __init__(self, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, table: torch.Tensor | None = None, kernels: object = None) -> None:
        self.cos, self.positions, self.table, self.kernels = cos, positions, table, kernels
        self.sin_signed = None if sin is None else signed_sin(sin)  # once per forward, shared by every layer

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, d], k [T, kv_heads, d] -> rotated (the fused path rotates them in place)."""
        if self.kernels is not None:
            t, d = q.shape[0], q.shape[-1]
            self.kernels.rope.apply_rope_with_cos_sin_cache_inplace(  # type: ignore[attr-defined]
                self.positions, q.view(t, -1), k.view(t, -1), d, self.table, is_neox=True)
            return q, k
        return self.rotate(q), self.rotate(k)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] -> rotated, a new tensor (torch path: the layers rotate q and k heads
        in one call when they sit side by side)."""
        assert self.cos is not None and self.sin_signed is not None
        return apply_rope(x, self.cos, self.sin_signed)
