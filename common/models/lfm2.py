"""LFM2 (Liquid AI): a hybrid of gated short convolutions and attention, with recurrent state.

    tokens -> embed -> L x [ RMSNorm -> (attention | short conv) -> +res -> RMSNorm -> SwiGLU -> +res ]
           -> RMSNorm (``embedding_norm``, last new token of each request) -> hidden [B, H]

Attention layers are the Llama family's (q/k per-head RMSNorm, like Qwen3) and keep KV in the
paged pool; attention layer i (counting attention layers only) owns KV buffer i. A short-conv
layer computes, per token t of a request::

    B, C, x = in_proj(h_t).chunk(3)           each [H]
    u_t = B * x                                the convolution's input
    y_t = C * sum_k w[:, k] * u_{t-K+1+k}      depthwise causal conv over the last K inputs
    out = out_proj(y_t)

so a request's state in that layer is its last K inputs ``u`` ([H, K], zeros before the first
token: HF's conv cache). It lives in the request's ``StatePool`` slot: chunked prefill reads it
and writes it back chunk after chunk, decode shifts one new column in per step, and the prefill
node sends the final one to the decode node with the last chunk's KV.

Why LFM2 for our first hybrid: transformers implements it in plain torch, its state is small and
fixed per layer (no selective-scan kernel to write), and its attention layers reuse ours.

Tensor parallelism is refused (tp > 1 raises ``ShardingError``): the conv layers' in/out
projections and per-request state would have to be split by channel and the state transfer
taught about it; not done yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.attention.base import AttentionBackend
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.models.arch import ModelArchConfig
from common.models.linear import linear
from common.models.llama import MLP, Attention, LlamaFamilyForCausalLM, RMSNorm, Targets, empty_param
from common.models.rope import Rope
from common.models.sharding import ShardingError
from common.parallel import SINGLE_RANK, TPGroup


class ShortConv(nn.Module):
    PACKED_LINEARS = ("in_proj", "out_proj")  # common/models/linear.py
    def __init__(self, arch: ModelArchConfig, state_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, k = arch.hidden_size, arch.conv_kernel
        self.hidden, self.kernel, self.state_layer = h, k, state_layer
        self.in_proj = empty_param(3 * h, h, dtype=dtype)
        self.in_bias = empty_param(3 * h, dtype=dtype) if arch.conv_bias else None
        self.conv_weight = empty_param(h, 1, k, dtype=dtype)  # depthwise: one K-tap filter per channel
        self.conv_bias = empty_param(h, dtype=dtype) if arch.conv_bias else None
        self.out_proj = empty_param(h, h, dtype=dtype)
        self.out_bias = empty_param(h, dtype=dtype) if arch.conv_bias else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.state_pool is not None and batch.state_slots is not None
        b, c, u = linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)  # [T, H] each
        u = b * u  # [T, H]
        state = batch.state_pool.buffers[self.state_layer]  # [slots, H, K]
        if batch.mode is ForwardMode.DECODE:
            slots = batch.state_slots  # [B]
            window = torch.cat([state[slots], u.unsqueeze(-1)], dim=-1)  # [B, H, K+1]
            state[slots] = window[..., 1:]
            conv = self._conv(window)[..., -1]  # [B, H]
        else:
            parts = []
            start = 0
            for slot, n in zip(batch.state_slots.tolist(), batch.extend_lens_cpu):
                window = torch.cat([state[slot], u[start : start + n].T], dim=-1)  # [H, K+n]
                state[slot] = window[:, -self.kernel :]
                parts.append(self._conv(window.unsqueeze(0))[0, :, -n:].T)  # [n, H]
                start += n
            conv = torch.cat(parts)  # [T, H]
        return linear(c * conv, self.out_proj, self.out_bias)  # [T, H]

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """[N, H, K+n] -> [N, H, n+1]: each output sees K consecutive inputs (no padding: the
        state columns are the left context)."""
        return F.conv1d(window, self.conv_weight, self.conv_bias, groups=self.hidden)


class Lfm2Layer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_id: int, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        assert tp.size == 1, "Lfm2ForCausalLM refuses tensor parallelism before building layers"
        self.operator_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.feed_forward = MLP(arch, dtype)
        self.self_attn: Attention | None = None
        self.conv: ShortConv | None = None
        if layer_id in arch.conv_layers:
            self.conv = ShortConv(arch, arch.conv_layers.index(layer_id), dtype)
        else:
            self.self_attn = Attention(arch, arch.attention_layers.index(layer_id), backend, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's feed-forward output, the residual stream before it), as
        the Llama family's layers (common/models/llama.py)."""
        x, residual = self.operator_norm.add(x, residual)
        x = self.conv(x, batch) if self.conv is not None else self.self_attn(x, rope, batch)  # type: ignore[misc]
        x, residual = self.ffn_norm.add(x, residual)
        return self.feed_forward(x), residual


class Lfm2ForCausalLM(LlamaFamilyForCausalLM):
    """The Llama family's shell (embedding, RoPE, final norm, tied LM head) over LFM2 layers; only
    the checkpoint's names differ."""

    layer_cls = Lfm2Layer

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype,
                 tp: TPGroup = SINGLE_RANK) -> None:
        if tp.size > 1:
            raise ShardingError(f"{arch.architecture} does not support tensor parallelism (tp size {tp.size}): "
                                "its short-convolution layers and their recurrent state are not sharded; use tp size 1")
        super().__init__(arch, backend, dtype, tp)

    def checkpoint_targets(self) -> Targets:
        """HF names -> views of our parameters (q/k/v and w1/w3 fused as in the Llama family)."""
        # LFM2's final norm is called embedding_norm (it runs after the last layer all the same).
        t: Targets = {"model.embed_tokens.weight": self.embed_tokens.data,
                      "model.embedding_norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            t["lm_head.weight"] = self.lm_head.data
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t[p + "operator_norm.weight"] = layer.operator_norm.weight.data
            t[p + "ffn_norm.weight"] = layer.ffn_norm.weight.data
            t.update(layer.feed_forward.checkpoint_targets(p + "feed_forward.", ("w1", "w3", "w2")))
            if layer.conv is not None:
                conv = layer.conv
                t[p + "conv.in_proj.weight"] = conv.in_proj.data
                t[p + "conv.conv.weight"] = conv.conv_weight.data
                t[p + "conv.out_proj.weight"] = conv.out_proj.data
                for name, bias in (("in_proj", conv.in_bias), ("conv", conv.conv_bias), ("out_proj", conv.out_bias)):
                    if bias is not None:
                        t[p + f"conv.{name}.bias"] = bias.data
            else:
                attn = layer.self_attn
                assert attn is not None and attn.q_norm is not None and attn.k_norm is not None
                t.update(attn.checkpoint_targets(p + "self_attn.", ("q_proj", "k_proj", "v_proj", "out_proj")))
                t[p + "self_attn.q_layernorm.weight"] = attn.q_norm.weight.data
                t[p + "self_attn.k_layernorm.weight"] = attn.k_norm.weight.data
        return t
