"""What the engine needs to know about a checkpoint, parsed once from config.json
(+ generation_config.json): layer shapes, RoPE, EOS ids, and from those the KV pool layout.

Accepts both config spellings seen in the wild: the hub's ``rope_theta`` + ``rope_scaling``
(``"type"`` or ``"rope_type"``) and transformers 5's ``rope_parameters``.

Hybrid models (LFM2) also say which layers are attention and which are short convolutions
(``layer_types``): only attention layers have KV pages; each convolution layer keeps a
per-request recurrent state (``state_layout``) that moves with the KV from prefill to decode.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from common.kvcache.pool import KVLayout
from common.kvcache.state_pool import StateLayout
from common.models.sharding import attention_shard

# Families whose q/k/v projections always carry a bias (no config flag says so).
_ALWAYS_QKV_BIAS = frozenset({"qwen2"})
# Families with a per-head RMSNorm on q and k before RoPE.
_QK_NORM = frozenset({"qwen3"})
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A checkpoint we cannot serve; the message names the directory and the offending item."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # e.g. "Qwen3ForCausalLM", the registry key
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]  # generation_config's first, then config's; deduplicated
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Per layer: "full_attention" or "conv" (LFM2's gated short convolution). Empty: all attention.
    layer_types: tuple[str, ...] = ()
    conv_kernel: int = 0  # taps of each conv layer (HF's conv_L_cache); also the state's width
    conv_bias: bool = False

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Model layer indices that hold KV, in order; KV buffer i belongs to the i-th of them."""
        return tuple(i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] != "conv")

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "conv")

    @property
    def has_state(self) -> bool:
        """Whether requests carry recurrent state besides their KV (a hybrid model)."""
        return bool(self.conv_layers)

    def state_layout(self, dtype: str | torch.dtype) -> StateLayout | None:
        """Per-request state of each conv layer: its last ``conv_kernel`` inputs, [hidden, kernel]
        (HF's conv cache shape per request, so bytes compare directly). None without conv layers."""
        if not self.has_state:
            return None
        return StateLayout(num_layers=len(self.conv_layers), shape=(self.hidden_size, self.conv_kernel),
                           dtype=_dtype_name(dtype))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_layout(self, page_size: int, dtype: str | torch.dtype, tp_size: int = 1, tp_rank: int = 0) -> KVLayout:
        """The KV pool layout for this model: one K and one V buffer per layer, holding the KV
        heads of TP rank ``tp_rank`` only (``num_kv_heads / tp_size``, or one replicated head)."""
        return KVLayout(
            num_layers=len(self.attention_layers),
            num_kv_heads=attention_shard(self.num_heads, self.num_kv_heads, tp_size, tp_rank).num_kv_heads,
            head_dim=self.head_dim,
            page_size=page_size,
            dtype=_dtype_name(dtype),
        )

    # -- parsing ---------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_path: str) -> ModelArchConfig:
        cfg_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"{model_path}: no config.json (is this a Hugging Face checkpoint directory?)")
        cfg = _read_json(cfg_path)
        gen_path = os.path.join(model_path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        try:
            return cls.from_hf(cfg, gen)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{cfg_path}: {exc}") from None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelArchConfig:
        """Parse a config.json dict (and optionally generation_config.json's)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config has no 'architectures' entry; cannot pick a model class")
        model_type = str(cfg.get("model_type", ""))
        hidden = _req_int(cfg, "hidden_size")
        num_heads = _req_int(cfg, "num_attention_heads")
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or 0) or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise ModelLoadError("use_sliding_window=true is not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        if model_type == "lfm2":
            return cls(**_lfm2_fields(cfg, archs, hidden, num_heads, num_kv_heads, head_dim, gen or {}))
        return cls(
            architecture=str(archs[0]),
            model_type=model_type,
            num_layers=_req_int(cfg, "num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=_req_int(cfg, "intermediate_size"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_req_int(cfg, "vocab_size"),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type in _ALWAYS_QKV_BIAS,
            # Qwen2's bias is on q/k/v only; Llama's attention_bias covers o_proj too.
            o_bias=attention_bias and model_type not in _ALWAYS_QKV_BIAS,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM,
            eos_token_ids=_eos_ids(gen or {}, cfg),
            bos_token_id=_opt_int(cfg.get("bos_token_id")),
            pad_token_id=_opt_int(cfg.get("pad_token_id")),
        )


def lfm2_intermediate_size(cfg: dict[str, Any]) -> int:
    """LFM2's MLP width: the configured size, or with ``block_auto_adjust_ff_dim`` two thirds of
    it, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of`` (as HF sizes w1)."""
    size = int(cfg.get("block_ff_dim") or cfg.get("intermediate_size") or 0)
    if size <= 0:
        raise ModelLoadError("config needs a positive intermediate_size (or block_ff_dim)")
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            size = int(float(mult) * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def _lfm2_fields(cfg: dict[str, Any], archs: list[Any], hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, gen: dict[str, Any]) -> dict[str, Any]:
    """LFM2's spelling: norm_eps, block_* MLP sizing, tied embeddings by default, q/k layernorm,
    no biases except optionally on the conv layers, ``layer_types`` or ``full_attn_idxs``."""
    n = _req_int(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        attn = cfg.get("full_attn_idxs")
        attn = set(range(n)) if attn is None else {int(i) for i in attn}
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if len(types) != n or any(t not in ("full_attention", "conv") for t in types):
        raise ModelLoadError(f"layer_types must list 'full_attention' or 'conv' for each of {n} layers, got {types!r}")
    kernel = int(cfg.get("conv_L_cache", 3))
    if kernel < 1:
        raise ModelLoadError(f"conv_L_cache must be >= 1, got {kernel}")
    tie = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
    return dict(
        architecture=str(archs[0]), model_type="lfm2", num_layers=n, hidden_size=hidden,
        intermediate_size=lfm2_intermediate_size(cfg), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=_req_int(cfg, "vocab_size"),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)), rope=parse_rope(cfg), tie_word_embeddings=bool(tie),
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, eos_token_ids=_eos_ids(gen, cfg),
        bos_token_id=_opt_int(cfg.get("bos_token_id")), pad_token_id=_opt_int(cfg.get("pad_token_id")),
        layer_types=tuple(types), conv_kernel=kernel, conv_bias=bool(cfg.get("conv_bias", False)),
    )


def _dtype_name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"unknown KV dtype {dtype!r}")
    return name


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:  # hub spelling: theta at top level, scaling dict (or null) beside it
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    # A per-layer-type mapping ({"full_attention": {...}}) is not something these families use.
    if "rope_theta" not in params and "rope_type" not in params and "type" not in params:
        raise ModelLoadError(f"unrecognised rope_parameters {params!r}")
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params.get("factor", 1.0))
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ModelLoadError("llama3 rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig),
    )


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _req_int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(value: Any) -> int | None:
    if isinstance(value, list):  # some configs put a list in bos/pad too; the first is canonical
        value = value[0] if value else None
    return None if value is None else int(value)


def _eos_ids(gen: dict[str, Any], cfg: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in src if isinstance(src, list) else ([] if src is None else [src]):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
