"""The Llama family (Llama 2/3, Qwen2, Qwen3): one implementation, switched by ModelArchConfig.

    tokens -> embed -> L x [ RMSNorm -> attention -> +res -> RMSNorm -> SwiGLU MLP -> +res ]
           -> RMSNorm (last new token of each request only) -> hidden [B, H]
    compute_logits(hidden) -> lm_head (or the tied embedding) -> [B, vocab] float32

Layers pass the residual stream on its own: a layer takes (x, residual), the last sublayer's output
and the running sum before it, and adds x in the same op as its first norm (``ops.add_rms_norm``,
one fused kernel on a GPU, common/models/ops.py); the final sum happens after the last layer.
The sums and norms are the same as ``h = h + sublayer(norm(h))``, in the same order.

Family differences are flags: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3: per-head RMSNorm on q
and k before RoPE), ``tie_word_embeddings``, RoPE scaling (Llama 3.1).

Everything runs on the packed tokens of the whole batch ([T, ...]); only the attention backend
knows where one request ends. q/k/v and gate/up are fused into one matmul each; the loader fills
the fused weights from the checkpoint's separate tensors (see ``checkpoint_targets``).
Parameters are allocated with ``torch.empty`` (no random init: every one is loaded).

Tensor parallelism (``tp``, see common/models/sharding.py): fused q/k/v and gate/up are
column-parallel (this rank's heads / its slice of the MLP width), o_proj and down_proj
row-parallel, each followed by one all-reduce: two per layer. Embedding, norms and the LM head
are replicated, so every rank computes the whole logits row itself (no gather). With tp = 1 the
sharded shapes are the full ones and no collective runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.engine.forward_batch import ForwardBatch
from common.models.arch import ModelArchConfig
from common.models import ops
from common.models.linear import BlockedWeight, linear
from common.models.rope import Rope, RotaryEmbedding
from common.models.sharding import ShardTarget, attention_shard, cols, rows, split_size
from common.parallel import SINGLE_RANK, TPGroup

# HF tensor name -> our parameter (or the slice of it this rank fills from a slice of the tensor).
Targets = dict[str, torch.Tensor | ShardTarget]


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup) -> torch.Tensor:
    """x [T, in/tp] @ weight[out, in/tp].T summed over the ranks, + bias once. [T, out]"""
    if tp.size == 1:
        return linear(x, weight, bias)  # the fused addmm, as before TP existed
    out = tp.all_reduce(linear(x, weight))  # [T, out] partial sums -> full sums on every rank
    return out if bias is None else out + bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the first layer has no residual yet: (norm(x), x)."""
        if residual is None:
            return self(x), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    PACKED_LINEARS = ("qkv_proj", "o_proj")  # common/models/linear.py
    def __init__(self, arch: ModelArchConfig, layer_id: int, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.arch = arch
        self.backend = backend
        self.tp = tp
        # This rank's query heads and the KV heads they read (all of them when tp = 1).
        self.shard = attention_shard(arch.num_heads, arch.num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * arch.head_dim, self.num_kv_heads * arch.head_dim
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = empty_param(qkv_out, arch.hidden_size, dtype=dtype)
        self.qkv_bias = empty_param(qkv_out, dtype=dtype) if arch.qkv_bias else None
        self.o_proj = empty_param(arch.hidden_size, self.q_size, dtype=dtype)
        self.o_bias = empty_param(arch.hidden_size, dtype=dtype) if arch.o_bias else None
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=arch.head_dim,
            scaling=arch.head_dim**-0.5,
        )

    def forward(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.arch.head_dim
        qkv = linear(x, self.qkv_proj, self.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if rope.kernels is None and ops.fused(qkv) is None:
            q, k = self._rotated_qk(qkv, rope)
        else:
            q = q.reshape(t, self.num_heads, d)  # [T, heads, head_dim] (this rank's heads)
            k = k.reshape(t, self.num_kv_heads, d)  # [T, kv_heads, head_dim]
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q, k)
        out = self.backend.forward(q.reshape(t, -1), k.reshape(t, -1), v, self.spec, batch)  # [T, q]; v a view of qkv
        return row_parallel_linear(out, self.o_proj, self.o_bias, self.tp)  # [T, H]

    def _rotated_qk(self, qkv: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: q and k heads sit side by side in ``qkv``, so they are normed (Qwen3)
        and rotated as one [T, heads + kv_heads, head_dim] tensor: the same elementwise ops as
        one head set at a time, in half the calls. -> q [T, heads, d], k [T, kv_heads, d] (views)."""
        t, d, hq = qkv.shape[0], self.arch.head_dim, self.num_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk = ops.rms_norm_heads(qk, ((hq, self.q_norm.weight), (self.num_kv_heads, self.k_norm.weight)),
                                    self.q_norm.eps)
        qk = rope.rotate(qk)
        return qk[:, :hq], qk[:, hq:]

    def checkpoint_targets(self, prefix: str, names: tuple[str, str, str, str]) -> Targets:
        """``prefix`` + q/k/v/o names (HF spells o_proj differently per family) -> our slices::

            qkv_proj rows: [0, q) <- q_proj | [q, q+kv) <- k_proj | [q+kv, q+2kv) <- v_proj
            o_proj columns <- o_proj's columns of this rank's query heads
        """
        d, s, a = self.arch.head_dim, self.shard, self.arch
        q, kv = self.q_size, self.kv_size
        q_start, kv_start = s.q_head_start * d, s.kv_head_start * d
        t: Targets = {}
        for kind, tensor in (("weight", self.qkv_proj), ("bias", self.qkv_bias)):
            if tensor is not None:
                t[f"{prefix}{names[0]}.{kind}"] = rows(tensor.data[:q], q_start, a.q_size)
                t[f"{prefix}{names[1]}.{kind}"] = rows(tensor.data[q : q + kv], kv_start, a.kv_size)
                t[f"{prefix}{names[2]}.{kind}"] = rows(tensor.data[q + kv :], kv_start, a.kv_size)
        t[f"{prefix}{names[3]}.weight"] = cols(self.o_proj.data, q_start, a.q_size)
        if self.o_bias is not None:
            t[f"{prefix}{names[3]}.bias"] = self.o_bias.data  # added once, after the all-reduce
        return t


class MLP(nn.Module):
    PACKED_LINEARS = ("gate_up_proj", "down_proj")
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.full_inter = arch.intermediate_size
        self.inter = split_size(arch.intermediate_size, tp.size, "intermediate_size")  # this rank's slice
        self.gate_up_proj = empty_param(2 * self.inter, arch.hidden_size, dtype=dtype)
        self.gate_up_bias = empty_param(2 * self.inter, dtype=dtype) if arch.mlp_bias else None
        self.down_proj = empty_param(arch.hidden_size, self.inter, dtype=dtype)
        self.down_bias = empty_param(arch.hidden_size, dtype=dtype) if arch.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj, self.gate_up_bias)  # [T, 2I]: gate | up
        return row_parallel_linear(ops.silu_mul(gate_up), self.down_proj, self.down_bias, self.tp)  # [T, H]

    def checkpoint_targets(self, prefix: str, names: tuple[str, str, str]) -> Targets:
        """``prefix`` + gate/up/down names -> our slices::

            gate_up_proj rows: [0, I) <- gate_proj | [I, 2I) <- up_proj    (I: this rank's width)
            down_proj columns <- the same slice of the intermediate dimension
        """
        i, start, full = self.inter, self.tp.rank * self.inter, self.full_inter
        t: Targets = {}
        for kind, tensor in (("weight", self.gate_up_proj), ("bias", self.gate_up_bias)):
            if tensor is not None:
                t[f"{prefix}{names[0]}.{kind}"] = rows(tensor.data[:i], start, full)
                t[f"{prefix}{names[1]}.{kind}"] = rows(tensor.data[i:], start, full)
        t[f"{prefix}{names[2]}.weight"] = cols(self.down_proj.data, start, full)
        if self.down_bias is not None:
            t[f"{prefix}{names[2]}.bias"] = self.down_bias.data  # added once, after the all-reduce
        return t


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_id: int, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, layer_id, backend, dtype, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); [T, H] each."""
        x, residual = self.input_layernorm.add(x, residual)
        x, residual = self.post_attention_layernorm.add(self.self_attn(x, rope, batch), residual)
        return self.mlp(x), residual


class LlamaFamilyForCausalLM(nn.Module):
    # What one layer is; a family that keeps this shell (embedding, RoPE, final norm, LM head)
    # and changes only its layers (LFM2) sets its own.
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.tp = tp
        # Replicated, not vocab-parallel: a vocab-parallel embedding costs an all-reduce of [T, H]
        # per forward and a vocab-parallel head a gather of [B, vocab] per step; replicated, each
        # rank computes the whole logits row itself and pays vocab x hidden of memory for it (a
        # few percent of an 8B model, but a quarter of Qwen3-0.6B: the first thing to shard if
        # small models at high tp run short of memory).
        self.embed_tokens = empty_param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self.layer_cls(arch, i, backend, dtype, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = None if arch.tie_word_embeddings else empty_param(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden state of each request's last new token, after the final norm. [B, H]"""
        x, residual = self.embed(batch.input_ids), None  # [T, H]
        rope = self.rotary.prepare(batch.positions, self.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, batch)
        h = x if residual is None else residual + x  # [T, H]
        return self.norm(h[batch.last_token_indices()])  # [B, H]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> embeddings [T, H] (from our kernel's layout where the tied head was
        packed for it: common/models/linear.py, ``pack_lm_head``)."""
        if isinstance(self.embed_tokens, BlockedWeight):
            return self.embed_tokens.rows(ids)
        return F.embedding(ids, self.embed_tokens)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, vocab] float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head).float()  # F.linear, or our kernel over a packed head

    def checkpoint_targets(self) -> Targets:
        """Every tensor the checkpoint must provide (HF names) -> the view of our parameter it
        fills, or a ``ShardTarget``: the slice of the checkpoint tensor this rank loads into a
        view (fused q/k/v and gate/up take several row slices; see ``Attention``/``MLP``)."""
        t: Targets = {"model.embed_tokens.weight": self.embed_tokens.data, "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            t["lm_head.weight"] = self.lm_head.data
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            t[p + "input_layernorm.weight"] = layer.input_layernorm.weight.data
            t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
            t.update(attn.checkpoint_targets(p + "self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj")))
            if attn.q_norm is not None and attn.k_norm is not None:
                t[p + "self_attn.q_norm.weight"] = attn.q_norm.weight.data
                t[p + "self_attn.k_norm.weight"] = attn.k_norm.weight.data
            t.update(mlp.checkpoint_targets(p + "mlp.", ("gate_proj", "up_proj", "down_proj")))
        return t

    def ignorable_checkpoint_tensor(self, name: str) -> bool:
        """Tensors some checkpoints carry that we derive or do not need."""
        if name.endswith("rotary_emb.inv_freq"):  # old exports saved the RoPE buffer
            return True
        # Tied checkpoints sometimes also store lm_head; the embedding is authoritative (as in HF).
        return name == "lm_head.weight" and self.lm_head is None
