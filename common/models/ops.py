"""The decoder layers' small ops (RMSNorm, residual add + RMSNorm, SiLU-and-mul) as plain torch,
or as one fused FlashInfer kernel each on CUDA.

Why fused: a decode step of a small model on a GPU is bound by kernel count, not bytes. The
torch RMSNorm is seven kernels (cast, square, mean, add, rsqrt, two multiplies); with four norms
per layer, rotary embeddings and SiLU-mul, a Qwen3-0.6B-shaped layer launched ~50 kernels, and a
CUDA-graph decode step at batch 1 took 17x its memory roofline (docs/BENCHMARKS.md, "GPU").

Which: fused when the tensor is on CUDA, flashinfer imports and ``PDC_FUSED_KERNELS`` is not 0;
the torch ops otherwise, and always on CPU: they are written as HF writes them (statistics in
float32, the weight applied in the model dtype), which the CPU tests against HF float32 hold to.
In float32 the norm is ``torch.rms_norm``: one dispatch instead of six, and bit-identical to
HF's formula on the pinned torch (tests/unit/test_ops.py checks it, so a torch upgrade that
changes it fails there first). A CPU decode step of a small model is mostly such dispatches.
The fused kernels keep float32 statistics but multiply by the weight before rounding, so in
bfloat16 they differ from HF in the last bit; the GPU tests compare against HF with that margin.

``add_rms_norm`` is the residual-stream form the layers use: it returns ``(norm(residual + x),
residual + x)``; the fused kernel does both in one pass and updates ``x`` and ``residual`` in
place, so a caller must not read either afterwards except through the returned tensors.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from common import envs


@functools.cache
def _flashinfer() -> ModuleType | None:
    if not envs.FUSED_KERNELS.get():
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def fused(x: torch.Tensor) -> ModuleType | None:
    """The kernel library to use on ``x``, or None for the torch ops."""
    return _flashinfer() if x.is_cuda else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] normalized over D, times weight [D]; same shape and dtype."""
    fi = fused(x)
    if fi is not None and x.dim() in (2, 3):
        return fi.norm.rmsnorm(x if x.is_contiguous() else x.contiguous(), weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)  # one call, the same bits (module docstring)
    return weight * _normalized(x, eps)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, no weight; same shape and dtype."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), None, eps)
    # Statistics in float32 whatever the model dtype, then back to the model dtype (as HF).
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype)


def rms_norm_heads(x: torch.Tensor, weights: tuple[tuple[int, torch.Tensor], ...], eps: float) -> torch.Tensor:
    """Per-head RMSNorm of x [T, heads, D] whose heads come in runs with their own weight:
    ``weights`` = ((n heads, weight [D]), ...) in head order (Qwen3's q_norm then k_norm over the
    q and k heads of one fused projection). One normalization for all heads, then one multiply
    per run: the same bits as ``rms_norm`` run by run, in fewer ops (torch path only; a new
    contiguous tensor)."""
    out = _normalized(x, eps)
    start = 0
    for n, w in weights:
        out[:, start:start + n].mul_(w)
        start += n
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x, residual [T, D] (module docstring)."""
    fi = fused(x)
    if fi is not None and x.is_contiguous() and residual.is_contiguous():
        fi.norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    fi = fused(gate_up)
    if fi is not None and gate_up.is_contiguous():
        return fi.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
