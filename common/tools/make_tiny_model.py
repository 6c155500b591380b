"""Write a tiny random-weight Hugging Face checkpoint for tests and first runs (no hub access).

Output directory::

    config.json              Qwen3ForCausalLM | LlamaForCausalLM | Qwen2ForCausalLM | Lfm2ForCausalLM
    generation_config.json   eos_token_id is a LIST (<|im_end|>, <|endoftext|>) to exercise multi-EOS
    model.safetensors        float32 random weights, deterministic for a seed
    tokenizer.json           byte-level BPE trained here on built-in text (round-trips any UTF-8)
    tokenizer_config.json    special tokens + a ChatML chat template

The variants differ on purpose so that code deriving a value from the wrong field breaks:

    arch    layers  heads/kv  head_dim          vocab  embeddings  extras
    qwen3   2       4/2       32 (!= 64/4)      ~1000  tied        q/k RMSNorm per head
    llama   3       4/2       absent (64/4=16)  ~512   untied      llama3 rope scaling
    qwen2   2       4/2       absent (64/4=16)  ~768   tied        q/k/v bias
    lfm2    5       4/2       absent (64/4=16)  ~1000  tied        hybrid: 3 short-conv layers
                                                                   (recurrent state) + 2 attention

Shapes for tensor-parallel tests and real-size runs: config overrides (``--num-attention-heads 8
--num-key-value-heads 4``, ``--hidden-size``, ``--num-hidden-layers``, ``--intermediate-size``,
``--head-dim``, ``--vocab-size``) and ``--shape`` presets with a real model's dimensions::

    shape          arch   layers  hidden  heads/kv  head_dim  inter  rope                    real vocab
    smollm2-135m   llama  30      576     9/3       64        1536   theta 1e5               49152
    qwen3-0.6b     qwen3  28      1024    16/8      128       3072   theta 1e6               151936
    llama-3.2-1b   llama  16      2048    32/8      64        8192   theta 5e5, llama3 x32   128256

All three tie their embeddings. The vocabulary is NOT the real one: the tokenizer trained here on
built-in text stops at ~1100 tokens whatever the target, and config.json always gets the size the
tokenizer reached (every id the model can emit decodes), presets included. Explicit overrides
win over the preset; ``--dtype bfloat16`` stores the weights (and ``torch_dtype``) in bfloat16.

``--script CHUNK`` (repeated; qwen3, llama, qwen2) writes a *scripted* checkpoint instead: each chunk
becomes one added (non-special) token, and the weights make greedy decoding after any chat prompt
(one ending in the assistant turn's ``\n``) emit the chunks in order, then ``<|im_end|>``: the
attention and MLP outputs are zero, so each step's logits depend on the current token alone, and
the embeddings and (untied) lm_head chain trigger -> chunk 1 -> ... -> chunk n -> EOS. It is how
the tests get an ``auto`` tool call out of a model end to end (tests/e2e/test_structured_pd.py)
without a real checkpoint; everything but the chain is as random as in a plain tiny model.

Weight scales are chosen so greedy decoding has clear winners (logit std ~8, so the top-2 gap
is rarely a near-tie) and context matters (attention scores of a few units, branch outputs
dominating the residual so tied embeddings do not just echo the input), see ``_init_std``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.models.arch import ModelArchConfig, ModelLoadError, lfm2_intermediate_size

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML, as Qwen ships it: each message framed by im_start/im_end, and an open assistant turn when
# add_generation_prompt is set. With ``tools`` (OpenAI tool objects) a system turn lists them and
# asks for Hermes-style <tool_call> blocks, as Qwen's template does; an assistant turn's
# tool_calls are rendered as such blocks and a ``tool`` message as a <tool_response>. Without
# tools the text is what the plain ChatML template renders.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{% set args = call['function']['arguments'] %}"
    "{{ '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{ args if args is string else (args | tojson) }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_cache": True,
    "torch_dtype": "float32",
}

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "head_dim": 32,
        "vocab_size": 1000,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 3,
        "vocab_size": 512,
        "rope_theta": 500000.0,
        # With head_dim 16 and theta 5e5 the wavelengths (6, 33, 170, 888, ...) straddle the
        # 64..256 band, so the unchanged, smoothed and divided-by-factor branches all occur.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "vocab_size": 768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    # LFM2 (Liquid AI): gated short-convolution layers mixed with attention. Hub spelling: norm_eps,
    # rope_parameters, block_* MLP sizing (auto-adjusted: int(2 * 160 / 3) = 106, rounded up to a
    # multiple of 32 = 128), layer_types in an uneven order so a layer-index mix-up shows.
    "lfm2": {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "num_hidden_layers": 5,
        "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention"],
        "vocab_size": 1000,
        "intermediate_size": 160,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 32,
        "conv_L_cache": 3,
        "conv_bias": False,
        "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    },
}

ARCHS = tuple(_ARCH_CONFIGS)

# Real models' dimensions (from their config.json on the hub), applied over the arch's tiny config.
# vocab_size is the tokenizer's training target only (see the module docstring).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("llama", {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 100000.0, "rope_scaling": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    }),
    "qwen3-0.6b": ("qwen3", {
        "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "max_window_layers": 28,
    }),
    "llama-3.2-1b": ("llama", {
        "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }),
}
DTYPES = ("float32", "bfloat16")
# CLI flag -> config.json key, for the size overrides the TP tests and real-shape runs need.
SIZE_FLAGS = {
    "num_attention_heads": "number of query heads",
    "num_key_value_heads": "number of KV heads",
    "hidden_size": "hidden size",
    "num_hidden_layers": "number of layers",
    "intermediate_size": "MLP width",
    "head_dim": "per-head dimension",
    "vocab_size": "tokenizer vocabulary target (config gets the size reached)",
}


# --------------------------------------------------------------------------- tokenizer

_TEXT = """\
The prefill node reads the whole prompt at once and writes the key and value cache for every
layer. The decode node then generates one token after another, reading the cache it received.
A router in front of the cluster picks the least loaded pair of nodes for each request.
Pages of the cache move over the network while the next chunk of the prompt is computed.
When a transfer fails, both sides free their pages and the client gets a clear error.
def forward(self, batch):
    hidden = self.embed(batch.input_ids)  # [tokens, hidden]
    for layer in self.layers:
        hidden = layer(hidden, batch)
    return self.norm(hidden)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828 -1 +1 = %
Punctuation: ( ) [ ] { } < > , . ; : ! ? ' " ` ~ @ # $ ^ & * _ - + = / \\ |
Unicode: café naïve über façade — “quotes” ‘single’ … ½ ° € £ ¥
中文：预填充节点和解码节点通过网络传输键值缓存。你好，世界！
日本語：こんにちは、世界。カタカナとひらがな。
한국어: 안녕하세요 세계
Emoji: 😀 🚀 🎉 👍 ❤️ 🔥 ✨ 🤖 🌍 🍕
"""

_WORDS = (
    "the a an of to in on for with by from at as is are was were be been has have had do does "
    "model token cache page layer node request batch prefill decode router server client stream "
    "memory transfer network queue scheduler kernel tensor weight vector matrix attention head "
    "fast slow small large first last next previous every some many few each other same new old "
    "read write send receive free allocate reserve compute store load save open close start stop "
    "time day year world people way thing man woman child life hand part place case week point "
    "good great long little own right big high different important public bad able young early "
    "say get make go know take see come think look want give use find tell ask work seem feel try"
).split()


def _corpus() -> list[str]:
    """Deterministic training text: fixed paragraphs plus seeded word salad (same every call)."""
    rng = random.Random(20240229)
    lines = _TEXT.splitlines()
    for _ in range(600):
        n = rng.randint(4, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:"))
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE: the 256-byte alphabet is always present, so every UTF-8 string encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------- weights


# Attention and MLP outputs are ~10x the embedding. With tied embeddings the logit of the current
# token is |e_t|^2 = hidden (8 std above the rest) whenever the residual is mostly e_t, and greedy
# decoding then repeats its input forever; branches this large bury e_t. Measured over 600 greedy
# steps per arch and seed: gain 1 collapses qwen3 to one token, 10 gives varied text.
BRANCH_GAIN = 10.0


def _init_std(cfg: dict[str, Any]) -> dict[str, float]:
    """Standard deviations per weight kind.

    Inputs of every projection are RMS-normalised (entries ~1), so a [out, in] weight with std s
    gives outputs with std ~ s * sqrt(in). We aim for: logits std ~8 (clear argmax), attention
    scores std of a few units (sharp but not one-hot), branch outputs much larger than the
    embedding (``BRANCH_GAIN``) so that attention and MLP decide the next token.
    """
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_dim = cfg["num_attention_heads"] * head_dim
    inter = cfg["intermediate_size"]
    return {
        "embed": 1.0,
        "lm_head": 1.0,
        # q, k entries std ~ sqrt(2) -> score q.k/sqrt(d) std ~ 2; qwen3 renormalises q/k anyway.
        "qk": 1.5 / hidden**0.5,
        "v": 1.0 / hidden**0.5,
        "o": BRANCH_GAIN / q_dim**0.5,
        "gate_up": 1.0 / hidden**0.5,
        "down": BRANCH_GAIN / inter**0.5,
        "bias": 0.3,
    }


def make_weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors named as HF names them (drawn in float32, stored in ``dtype`` one by one, so
    a bfloat16 model never holds a float32 copy of itself); norm weights near (not at) 1 so a
    loader that forgets to load them is caught."""
    gen = torch.Generator().manual_seed(seed)
    std = _init_std(cfg)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // n_heads
    model_type = cfg["model_type"]
    qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = model_type != "qwen2" and bool(cfg.get("attention_bias"))
    mlp_bias = bool(cfg.get("mlp_bias"))

    def randn(*shape: int, scale: float, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale + offset).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return randn(n, scale=0.1, offset=1.0)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab, hidden, scale=std["embed"])}
    if model_type == "lfm2":
        return _lfm2_weights(cfg, w, randn, norm, std)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = randn(n_heads * head_dim, hidden, scale=std["qk"])
        w[p + "self_attn.k_proj.weight"] = randn(n_kv * head_dim, hidden, scale=std["qk"])
        w[p + "self_attn.v_proj.weight"] = randn(n_kv * head_dim, hidden, scale=std["v"])
        w[p + "self_attn.o_proj.weight"] = randn(hidden, n_heads * head_dim, scale=std["o"])
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = randn(n_heads * head_dim, scale=std["bias"])
            w[p + "self_attn.k_proj.bias"] = randn(n_kv * head_dim, scale=std["bias"])
            w[p + "self_attn.v_proj.bias"] = randn(n_kv * head_dim, scale=std["bias"])
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = randn(hidden, scale=std["bias"])
        if model_type == "qwen3":
            # per-head q/k RMSNorm: weight ~1.5 so scores q.k/sqrt(d) have std ~2 after renormalising
            w[p + "self_attn.q_norm.weight"] = randn(head_dim, scale=0.1, offset=1.5)
            w[p + "self_attn.k_norm.weight"] = randn(head_dim, scale=0.1, offset=1.5)
        w[p + "mlp.gate_proj.weight"] = randn(inter, hidden, scale=std["gate_up"])
        w[p + "mlp.up_proj.weight"] = randn(inter, hidden, scale=std["gate_up"])
        w[p + "mlp.down_proj.weight"] = randn(hidden, inter, scale=std["down"])
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = randn(inter, scale=std["bias"])
            w[p + "mlp.up_proj.bias"] = randn(inter, scale=std["bias"])
            w[p + "mlp.down_proj.bias"] = randn(hidden, scale=std["bias"])
    w["model.norm.weight"] = norm(hidden)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = randn(vocab, hidden, scale=std["lm_head"])
    return w


def _lfm2_weights(cfg: dict[str, Any], w: dict[str, torch.Tensor], randn: Any, norm: Any, std: dict[str, float]) -> dict[str, torch.Tensor]:
    """LFM2's names. A conv layer: in_proj -> (B, C, x); y = C * conv(B * x) -> out_proj. With
    in_proj entries ~1 and a conv tap std of 1/sqrt(3), y is ~1 like an attention output."""
    hidden, n_heads, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, width = cfg.get("head_dim") or hidden // n_heads, cfg["conv_L_cache"]
    inter = lfm2_intermediate_size(cfg)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "operator_norm.weight"] = norm(hidden)
        w[p + "ffn_norm.weight"] = norm(hidden)
        if kind == "conv":
            w[p + "conv.in_proj.weight"] = randn(3 * hidden, hidden, scale=1.0 / hidden**0.5)
            w[p + "conv.conv.weight"] = randn(hidden, 1, width, scale=1.0 / width**0.5)
            w[p + "conv.out_proj.weight"] = randn(hidden, hidden, scale=std["o"])
        else:
            w[p + "self_attn.q_proj.weight"] = randn(n_heads * head_dim, hidden, scale=std["qk"])
            w[p + "self_attn.k_proj.weight"] = randn(n_kv * head_dim, hidden, scale=std["qk"])
            w[p + "self_attn.v_proj.weight"] = randn(n_kv * head_dim, hidden, scale=std["v"])
            w[p + "self_attn.out_proj.weight"] = randn(hidden, n_heads * head_dim, scale=std["o"])
            w[p + "self_attn.q_layernorm.weight"] = randn(head_dim, scale=0.1, offset=1.5)
            w[p + "self_attn.k_layernorm.weight"] = randn(head_dim, scale=0.1, offset=1.5)
        w[p + "feed_forward.w1.weight"] = randn(inter, hidden, scale=std["gate_up"])
        w[p + "feed_forward.w3.weight"] = randn(inter, hidden, scale=std["gate_up"])
        w[p + "feed_forward.w2.weight"] = randn(hidden, inter, scale=BRANCH_GAIN / inter**0.5)
    w["model.embedding_norm.weight"] = norm(hidden)  # LFM2's final norm, despite its name
    return w


# --------------------------------------------------------------------------- entry points


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def tiny_config(arch: str | None = None, shape: str | None = None, dtype: str = "float32",
                **overrides: Any) -> dict[str, Any]:
    """config.json before the tokenizer fixes vocab_size and the special ids: the arch's tiny
    config, then the ``shape`` preset, then ``overrides``. Raises ValueError for an unknown
    arch/shape/dtype, an arch that contradicts the shape, or a config our loader would refuse."""
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
        shape_arch, preset = SHAPES[shape]
        if arch is not None and arch != shape_arch:
            raise ValueError(f"--shape {shape} is a {shape_arch} model, not --arch {arch}")
        arch = shape_arch
    arch = arch or "qwen3"
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    cfg = copy.deepcopy(_COMMON)
    cfg.update(copy.deepcopy(_ARCH_CONFIGS[arch]))
    if shape is not None:
        cfg.update(copy.deepcopy(preset))
    cfg.update(overrides)
    cfg["torch_dtype"] = dtype
    try:
        ModelArchConfig.from_hf(cfg)  # what the engine will parse: refuse bad head counts here
    except ModelLoadError as exc:
        raise ValueError(f"tiny-model config is not servable: {exc}") from None
    return cfg


# The chain's logit: lm_head row (SCRIPT_LOGIT x a unit vector) against a normed hidden state of
# size ~sqrt(hidden) on that unit vector, far above any random row (logit std ~8).
SCRIPT_LOGIT = 20.0


def _script_weights(w: dict[str, torch.Tensor], cfg: dict[str, Any], chain: list[int]) -> None:
    """Rewrite ``w`` in place so greedy decoding follows ``chain`` (token i -> token i + 1): every
    attention and MLP output projection is zero (the residual stream is the current token's
    embedding), token i's embedding is unit vector i, and lm_head's row for token i + 1 is
    SCRIPT_LOGIT x unit vector i."""
    hidden = cfg["hidden_size"]
    if len(chain) - 1 > hidden:
        raise ValueError(f"a script of {len(chain) - 2} chunks needs hidden_size >= {len(chain) - 1}")
    for name, t in w.items():
        if name.endswith(("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight",
                          "mlp.down_proj.bias")):
            w[name] = torch.zeros_like(t)
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    for i, (cur, nxt) in enumerate(zip(chain, chain[1:])):
        unit = torch.zeros(hidden, dtype=embed.dtype)  # [hidden]
        unit[i] = 1.0
        embed[cur] = unit
        head[nxt] = unit * SCRIPT_LOGIT


def make_tiny_model(out_dir: str, arch: str | None = None, seed: int = 0, shape: str | None = None,
                    dtype: str = "float32", script: Sequence[str] | None = None, **overrides: Any) -> str:
    """Write a tiny checkpoint of ``arch`` (default qwen3, or the ``shape`` preset's) to ``out_dir``
    (created if missing); return ``out_dir``.

    ``overrides`` replace config.json keys (e.g. ``num_hidden_layers=4``), after the preset.
    ``vocab_size`` is the tokenizer's training target; config.json gets the size actually
    reached, so every id the model can emit decodes. Same arguments give byte-identical files.
    ``script``: the chunks a scripted checkpoint emits (module docstring).
    """
    cfg = tiny_config(arch, shape, dtype, **overrides)
    if script is not None:
        if cfg["model_type"] == "lfm2" or not script or len(set(script)) != len(script) or "" in script:
            raise ValueError("--script needs distinct non-empty chunks and an attention-only arch (not lfm2)")
        cfg["tie_word_embeddings"] = False  # the chain needs lm_head rows apart from the embeddings

    tok = build_tokenizer(int(cfg["vocab_size"]))
    if script is not None:
        tok.add_tokens([AddedToken(c, special=False, normalized=False) for c in script])
    cfg["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    cfg.update({"bos_token_id": eot, "eos_token_id": im_end, "pad_token_id": eot})

    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot},
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), _tokenizer_config(tok))
    weights = make_weights(cfg, seed, getattr(torch, dtype))
    if script is not None:
        # The trigger: the last token of the generation prompt "<|im_start|>assistant\n".
        trigger = tok.encode(IM_START + "assistant\n", add_special_tokens=False).ids[-1]
        _script_weights(weights, cfg, [trigger, *(tok.token_to_id(c) for c in script), im_end])
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdcluster make-tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    parser.add_argument("--arch", default=None, choices=ARCHS, help="model family (default: qwen3, or the --shape's)")
    parser.add_argument("--shape", default=None, choices=tuple(SHAPES),
                        help="a real model's dimensions (the vocabulary stays the tiny tokenizer's)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument("--script", action="append", default=None, metavar="CHUNK",
                        help="repeated: a scripted checkpoint, whose greedy answer to a chat prompt is these "
                             "chunks in order, then EOS")
    for key, what in SIZE_FLAGS.items():
        parser.add_argument("--" + key.replace("_", "-"), dest=key, type=int, default=None, metavar="N",
                            help=f"config.json {key}: {what}")
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    try:
        path = make_tiny_model(args.out, arch=args.arch, seed=args.seed, shape=args.shape, dtype=args.dtype,
                               script=args.script, **overrides)
    except ValueError as exc:
        parser.error(str(exc))  # exit 2 with the reason, before anything is written
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
