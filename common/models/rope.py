"""Rotary position embeddings, "rotate half" (GPT-NeoX) layout as Llama/Qwen checkpoints use.

A head vector is split in two halves that form complex pairs (x[i], x[i + d/2]) rotated by
angle ``position * inv_freq[i]``::

    out[:d/2] = x[:d/2] * cos - x[d/2:] * sin
    out[d/2:] = x[d/2:] * cos + x[:d/2] * sin

cos/sin are computed per forward from the packed positions (float32, one tiny outer product
shared by every layer) instead of a max-length table, so positions are never out of range.
"""
from __future__ import annotations

import math

import torch

from common.models.arch import RopeConfig


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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, 1, head_dim] in ``dtype`` (broadcast over heads)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2] float32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, 1, head_dim] -> rotated x, same shape and dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, d]
    return x * cos + rotated * sin
