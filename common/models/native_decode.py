"""A Llama-family decode step as one call of our C++ kernel (common/kernels/decode_step.cpp).

Why. With our projection and attention kernels, a decode step of SmolLM2-135M's shape at one
row took 16-18 ms against an 11.1-ms roofline; its projections were 11.5 of them. The rest was
the ~20 torch ops per layer between the kernels (norms, RoPE, residual adds, SiLU-mul, the K/V
writes to the pool and the mirror), each a dispatch of a few microseconds on a few hundred
floats, and the Python around them. The kernel runs all of it as loops in cache between the same
two kernels, and Python makes one call per step (docs/BENCHMARKS.md, "A decode step in one call").

When. Built once by the runner (``NativeDecode.build``) where it can run every step the same way:

- the CPU, float32, one TP rank, a model whose every layer is the Llama family's ``DecoderLayer``
  (Llama, Qwen2, Qwen3; not LFM2's conv layers);
- every projection in our blocked layout (``--cpu-linear auto`` where our kernel builds, or
  ``native``), so the step's weights are what ``linear.h`` reads;
- the torch backend with the decode mirror and its attention kernel, head_dim a multiple of 16.

Then each DECODE batch the backend planned over the mirror (``MirrorPlan``) runs here; EXTEND
and batches the mirror's budget does not cover run the layers as before. ``PDC_NATIVE_DECODE_STEP=0``
keeps the layer-by-layer path (with the same kernels inside) for comparison.

What it shares with the layer path: the KV pool stays the truth (new K/V are written to their
slots, as ``set_kv`` does), the mirror's lanes are brought up to date by the mirror itself
(``DecodeMirror.prepare``: moves and fills) and then appended by the kernel. The kernel also runs
the step's ends: the embedding lookup, RoPE's cos/sin from the rotary module's ``inv_freq`` (the
same float32 angles, cos and sin from the C library, within an ulp of torch's), and the head where
it is packed for our projection kernel (``pack_lm_head``; another head runs in torch). Those were
~0.5 ms of torch ops and calls around a one-row step of ~18 ms. The numbers are the layer path's
up to float32 rounding (sums in other orders); tests/unit/test_native_decode.py holds the two paths
together and the engine tests hold it to HF.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from common import envs, kernels
from common.attention.decode_mirror import MirrorPlan
from common.attention.torch_backend import TorchAttentionBackend
from common.engine.forward_batch import ForwardBatch
from common.kvcache.pool import KVPool
from common.models.linear import BlockedWeight
from common.models.llama import DecoderLayer, LlamaFamilyForCausalLM
from common.parallel import TPGroup

log = logging.getLogger(__name__)


def _ptr(t: torch.Tensor | BlockedWeight | None) -> int | None:
    if t is None:
        return None
    if isinstance(t, BlockedWeight):
        return t.blocks.data_ptr()
    assert t.is_contiguous() and t.dtype == torch.float32
    return t.data_ptr()


class NativeDecode:
    def __init__(self, model: LlamaFamilyForCausalLM, backend: TorchAttentionBackend, kv_pool: KVPool,
                 kernel: kernels.DecodeStep) -> None:
        """Use ``build``: it checks what this assumes."""
        assert backend.mirror is not None
        self.model, self.mirror, self.kv_pool, self.kernel = model, backend.mirror, kv_pool, kernel
        arch, layers = model.arch, model.layers
        self.layers = (kernels.DecodeStep.Layer * len(layers))()
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            entry = self.layers[i]
            entry.input_norm = _ptr(layer.input_layernorm.weight)
            entry.post_norm = _ptr(layer.post_attention_layernorm.weight)
            entry.q_norm = _ptr(None if attn.q_norm is None else attn.q_norm.weight)
            entry.k_norm = _ptr(None if attn.k_norm is None else attn.k_norm.weight)
            entry.qkv, entry.qkv_bias = _ptr(attn.qkv_proj), _ptr(attn.qkv_bias)
            entry.o, entry.o_bias = _ptr(attn.o_proj), _ptr(attn.o_bias)
            entry.gate_up, entry.gate_up_bias = _ptr(mlp.gate_up_proj), _ptr(mlp.gate_up_bias)
            entry.down, entry.down_bias = _ptr(mlp.down_proj), _ptr(mlp.down_bias)
            entry.k_pool, entry.v_pool = _ptr(kv_pool.k_buffers[i]), _ptr(kv_pool.v_buffers[i])
        self.shape = kernels.DecodeStep.Shape(
            layers=len(layers), hidden=arch.hidden_size, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim, inter=layers[0].mlp.inter, s_cap=0, eps=arch.rms_norm_eps,
            scale=layers[0].self_attn.spec.scaling)
        # The ends the kernel runs too: embedding lookup, RoPE angles, head (where it is packed).
        # (self.model keeps every tensor these pointers point into.)
        embed, head = model.embed_tokens, model.embed_tokens if model.lm_head is None else model.lm_head
        self.model_ends = kernels.DecodeStep.Model(
            embed=_ptr(embed), embed_rows=embed.out_features if isinstance(embed, BlockedWeight) else embed.shape[0],
            embed_packed=int(isinstance(embed, BlockedWeight)), inv_freq=_ptr(model.rotary.inv_freq),
            final_norm=_ptr(model.norm.weight), head=_ptr(head) if isinstance(head, BlockedWeight) else None,
            vocab=arch.vocab_size)
        self._mirror_generation = -1  # the mirror buffers the layer table points at
        self._scratch = torch.empty(0, dtype=torch.float32)

    @classmethod
    def build(cls, model: torch.nn.Module, backend: object, kv_pool: KVPool, tp: TPGroup) -> NativeDecode | None:
        """The whole-step path for this runner, or None where a step must run layer by layer
        (module docstring: when)."""
        if not envs.NATIVE_DECODE_STEP.get():
            return None
        if not (isinstance(model, LlamaFamilyForCausalLM) and isinstance(backend, TorchAttentionBackend)):
            return None
        if (tp.size != 1 or backend.mirror is None or backend.native_decode is None or model.dtype != torch.float32
                or model.embed_tokens.device.type != "cpu"):
            return None
        arch = model.arch
        if arch.head_dim % kernels.VECTOR_FLOATS or arch.head_dim > kernels.DecodeStep.MAX_HEAD_DIM:
            return None
        for layer in model.layers:
            if type(layer) is not DecoderLayer:
                return None
            weights = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(isinstance(w, BlockedWeight) for w in weights):
                return None
        if any(b.dtype != torch.float32 or not b.is_contiguous() for b in kv_pool.buffers()):
            return None
        kernel = kernels.decode_step()
        if kernel is None:
            return None
        log.info("decode steps run as one call of our kernel (PDC_NATIVE_DECODE_STEP=0: layer by layer)")
        return cls(model, backend, kv_pool, kernel)

    def takes(self, batch: ForwardBatch) -> bool:
        return isinstance(batch.attn_metadata, MirrorPlan)

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's ``forward`` and ``compute_logits`` for a batch ``takes`` accepts: [B, vocab]
        float32 (the head in the kernel where it is packed for it, else the model's)."""
        plan = batch.attn_metadata
        assert isinstance(plan, MirrorPlan)
        ids = batch.input_ids
        if ids.dtype != torch.int64 or not ids.is_contiguous():
            raise ValueError(f"decode step: token ids must be contiguous int64, got {ids.dtype}"
                             f"{'' if ids.is_contiguous() else ', not contiguous'}")
        pool = self.kv_pool
        self.mirror.prepare(plan, pool.k_buffers, pool.v_buffers)
        self._point_at_mirror()
        threads = max(1, torch.get_num_threads())
        need = self.kernel.scratch_floats(self.shape, ids.shape[0], threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        hidden, logits = self.kernel(self.layers, self.shape, self.model_ends, ids, batch.out_cache_loc, plan.lanes,
                                     batch.positions, batch.seq_lens, self._scratch, threads)
        return self.model.compute_logits(hidden) if logits is None else logits

    def _point_at_mirror(self) -> None:
        """Point the layer table at the mirror's current buffers (they move when it grows)."""
        if self.mirror.generation == self._mirror_generation:
            return
        whole = [self.mirror.whole(i) for i in range(len(self.layers))]
        s_caps = {kernels.key_dims(k)[1] for k, _ in whole}
        layouts = {k.dim() for k, _ in whole}
        assert len(s_caps) == 1 and len(layouts) == 1 and all(v.shape[2] == kernels.key_dims(k)[1] for k, v in whole), \
            "mirror layers disagree"
        for entry, (k, v) in zip(self.layers, whole):
            assert k.is_contiguous() and v.is_contiguous()
            entry.k_mirror, entry.v_mirror = k.data_ptr(), v.data_ptr()
        self.shape.s_cap = s_caps.pop()
        self.shape.blocked_keys = int(layouts.pop() == 5)
        self._mirror_generation = self.mirror.generation
