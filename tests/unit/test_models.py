"""Models and loader against HF transformers (float32): same logits, any batching or chunking."""
from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.attention.torch_backend import TorchAttentionBackend
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.kvcache.pool import KVPool
from common.models import ModelArchConfig, ModelLoadError, RopeConfig, checkpoint_files, load_model
from common.models.rope import inv_frequencies
from tests.reference import hf_logits

ATOL = 1e-4  # float32, same math in a different order; logits have magnitude ~20


class Harness:
    """Minimal engine around a model: a KV pool, a req->token table with pages handed out in a
    shuffled order (so a request's KV is scattered), and ForwardBatch construction."""

    PAGE = 4

    def __init__(self, model: torch.nn.Module, max_reqs: int = 4, max_ctx: int = 128) -> None:
        self.model = model
        self.backend = model.layers[0].self_attn.backend
        num_pages = 1 + max_reqs * max_ctx // self.PAGE
        self.pool = KVPool(model.arch.kv_layout(self.PAGE, "float32"), num_pages, "cpu")
        self.table = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)  # [reqs, ctx] slots
        pages = list(range(1, num_pages))
        random.Random(7).shuffle(pages)
        per_req = max_ctx // self.PAGE
        for r in range(max_reqs):
            mine = torch.tensor(pages[r * per_req : (r + 1) * per_req])  # [per_req]
            slots = mine[:, None] * self.PAGE + torch.arange(self.PAGE)[None, :]  # [per_req, PAGE]
            self.table[r] = slots.reshape(-1).to(torch.int32)

    def step(self, mode: ForwardMode, items: Sequence[tuple[int, Sequence[int], int]]) -> torch.Tensor:
        """items: (row, new token ids, prefix_len). Returns last-token logits [B, vocab]."""
        ids = [t for _, toks, _ in items for t in toks]
        pos = [p for _, toks, pre in items for p in range(pre, pre + len(toks))]
        rows = [r for r, toks, _ in items for _ in toks]
        lens = [len(toks) for _, toks, _ in items]
        pre = [p for _, _, p in items]
        seq = [p + n for p, n in zip(pre, lens)]
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=self.table[torch.tensor(rows), torch.tensor(pos)].long(),
            req_pool_indices=torch.tensor([r for r, _, _ in items], dtype=torch.int64),
            seq_lens=torch.tensor(seq, dtype=torch.int64),
            prefix_lens=torch.tensor(pre, dtype=torch.int64),
            extend_lens=torch.tensor(lens, dtype=torch.int64),
            req_to_token=self.table,
            kv_pool=self.pool,
            seq_lens_cpu=seq,
            prefix_lens_cpu=pre,
            extend_lens_cpu=lens,
        )
        self.backend.init_forward_metadata(batch)
        hidden = self.model.forward(batch)  # [B, hidden]
        assert hidden.shape == (len(items), self.model.arch.hidden_size)
        return self.model.compute_logits(hidden)  # [B, vocab]


def _load(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(path, dtype, "cpu", TorchAttentionBackend())


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def loaded(tiny_model_factory: Callable[..., str]) -> Callable[[str], tuple[str, torch.nn.Module]]:
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(arch: str) -> tuple[str, torch.nn.Module]:
        if arch not in cache:
            path = tiny_model_factory(arch)
            cache[arch] = (path, _load(path))
        return cache[arch]

    return get


# --------------------------------------------------------------------------- config


def test_arch_config_of_tiny_models(tiny_qwen3: str, tiny_llama: str) -> None:
    q = ModelArchConfig.from_model_dir(tiny_qwen3)
    assert (q.architecture, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == ("Qwen3ForCausalLM", 2, 4, 2, 32)
    assert q.qk_norm and q.tie_word_embeddings and not q.qkv_bias
    with open(os.path.join(tiny_qwen3, "generation_config.json")) as f:
        assert list(q.eos_token_ids) == json.load(f)["eos_token_id"]
    lm = ModelArchConfig.from_model_dir(tiny_llama)
    assert lm.head_dim == 16  # absent from config.json: hidden / heads
    assert not lm.tie_word_embeddings and not lm.qk_norm
    assert lm.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 256)
    layout = lm.kv_layout(16, torch.bfloat16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype) == (3, 2, 16, 16, "bfloat16")
    assert lm.kv_layout(16, "bfloat16") == layout
    assert layout.bytes_per_token_per_layer == 2 * 16 * 2


def test_arch_config_of_the_hybrid_model(tiny_lfm2: str) -> None:
    from tests.reference import hf_model

    a = ModelArchConfig.from_model_dir(tiny_lfm2)
    hf = hf_model(tiny_lfm2)
    assert a.layer_types == tuple(hf.config.layer_types)
    assert (a.attention_layers, a.conv_layers, a.conv_kernel) == ((1, 4), (0, 2, 3), 3)
    # the MLP width HF derives (two thirds of 160, rounded up to a multiple of 32)
    assert a.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features == 128
    assert a.rms_norm_eps == hf.config.norm_eps and a.qk_norm and a.tie_word_embeddings
    assert a.kv_layout(16, "float32").num_layers == 2, "only attention layers have KV"
    state = a.state_layout(torch.bfloat16)
    assert state is not None and (state.num_layers, state.shape, state.dtype) == (3, (64, 3), "bfloat16")
    assert a.has_state


@pytest.mark.parametrize(("changes", "want"), [
    ({"layer_types": None, "full_attn_idxs": [0, 3]}, ("full_attention", "conv", "conv", "full_attention", "conv")),
    ({"layer_types": None}, ("full_attention",) * 5),  # HF's default: every layer attends
])
def test_lfm2_layer_types_from_full_attn_idxs(tiny_lfm2: str, changes: dict, want: tuple) -> None:
    with open(os.path.join(tiny_lfm2, "config.json")) as f:
        cfg = {**json.load(f), **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    a = ModelArchConfig.from_hf(cfg)
    assert a.layer_types == want and a.has_state == ("conv" in want)


@pytest.mark.parametrize(("changes", "match"), [
    ({"layer_types": ["conv"] * 4}, "layer_types"),
    ({"layer_types": ["conv", "mamba", "conv", "conv", "full_attention"]}, "layer_types"),
    ({"conv_L_cache": 0}, "conv_L_cache"),
])
def test_lfm2_bad_config_is_refused(tiny_lfm2: str, changes: dict, match: str) -> None:
    with open(os.path.join(tiny_lfm2, "config.json")) as f:
        cfg = {**json.load(f), **changes}
    with pytest.raises(ModelLoadError, match=match):
        ModelArchConfig.from_hf(cfg)


def test_rope_spellings_agree() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hub = ModelArchConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    old = ModelArchConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    v5 = ModelArchConfig.from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert hub.rope == old.rope == v5.rope
    assert ModelArchConfig.from_hf({**base, "rope_theta": 1e4}).rope == RopeConfig(1e4)
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        ModelArchConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="'num_hidden_layers' must be a positive integer"):
        ModelArchConfig.from_hf({**base, "num_hidden_layers": None})
    with pytest.raises(ModelLoadError, match="not a multiple"):
        ModelArchConfig.from_hf({**base, "num_key_value_heads": 3})


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ],
)
def test_rope_frequencies_match_hf(scaling: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_theta": 5e5, **scaling})
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    ours = inv_frequencies(ModelArchConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope, 32)
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, inv_frequencies(RopeConfig(5e5), 32))  # scaling did something


# --------------------------------------------------------------------------- forward vs HF


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_full_prompt_logits_match_hf(loaded: Callable, arch: str) -> None:
    path, model = loaded(arch)
    prompt = _prompt(37, seed=1, vocab=model.arch.vocab_size)
    logits = Harness(model).step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]  # [vocab]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(path, prompt)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_batched_extend_then_decode_match_hf(loaded: Callable, arch: str) -> None:
    """Three requests of different lengths packed in one EXTEND batch, then batched DECODE steps."""
    path, model = loaded(arch)
    vocab = model.arch.vocab_size
    prompts = [_prompt(n, seed=n, vocab=vocab) for n in (5, 23, 1)]
    h = Harness(model)
    logits = h.step(ForwardMode.EXTEND, [(r, p, 0) for r, p in enumerate(prompts)])  # [3, vocab]
    seqs = [list(p) for p in prompts]
    for step in range(3):
        for r, s in enumerate(seqs):
            torch.testing.assert_close(logits[r], hf_logits(path, s)[-1], atol=ATOL, rtol=0, msg=f"req {r} step {step}")
        nxt = [int(t) for t in logits.argmax(-1)]
        logits = h.step(ForwardMode.DECODE, [(r, [nxt[r]], len(s)) for r, s in enumerate(seqs)])
        for r, s in enumerate(seqs):
            s.append(nxt[r])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_extend_after_cached_prefix_equals_one_shot(loaded: Callable, arch: str) -> None:
    path, model = loaded(arch)
    prompt = _prompt(41, seed=2, vocab=model.arch.vocab_size)
    one_shot = Harness(model).step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]
    h = Harness(model)
    h.step(ForwardMode.EXTEND, [(1, prompt[:16], 0)])  # a page-aligned cached prefix
    h.step(ForwardMode.EXTEND, [(1, prompt[16:30], 16)])  # a chunk ending mid-page
    chunked = h.step(ForwardMode.EXTEND, [(1, prompt[30:], 30)])[0]
    torch.testing.assert_close(chunked, one_shot, atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked, hf_logits(path, prompt)[-1], atol=ATOL, rtol=0)


def test_long_positions_past_llama3_original_context(loaded: Callable) -> None:
    """Positions beyond original_max_position_embeddings (256) go through the scaled RoPE."""
    path, model = loaded("llama")
    prompt = _prompt(300, seed=3, vocab=model.arch.vocab_size)
    logits = Harness(model, max_reqs=1, max_ctx=320).step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]
    torch.testing.assert_close(logits, hf_logits(path, prompt)[-1], atol=ATOL, rtol=0)


def test_bfloat16_load_runs_close_to_float32(loaded: Callable) -> None:
    path, model32 = loaded("qwen3")
    model16 = _load(path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    prompt = _prompt(12, seed=4, vocab=model32.arch.vocab_size)
    h16 = Harness(model16)
    h16.pool = KVPool(model16.arch.kv_layout(Harness.PAGE, "bfloat16"), h16.pool.num_pages, "cpu")
    l16 = h16.step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]
    l32 = Harness(model32).step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]
    assert l16.dtype == torch.float32
    assert torch.corrcoef(torch.stack([l16, l32]))[0, 1] > 0.99


# --------------------------------------------------------------------------- checkpoints


def _copy(src: str, dst: os.PathLike) -> str:
    return shutil.copytree(src, str(dst))


def test_sharded_checkpoint_loads_identically(loaded: Callable, tmp_path: os.PathLike) -> None:
    path, model = loaded("llama")
    out = _copy(path, tmp_path / "sharded")
    tensors = load_file(os.path.join(out, "model.safetensors"))
    os.remove(os.path.join(out, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(out, fname))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: fn for fn, ks in shards.items() for k in ks}}, f)
    assert [os.path.basename(p) for p in checkpoint_files(out)] == sorted(shards)
    sharded = _load(out)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), sharded.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def _rewrite_weights(path: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _rewrite_config(path: str, **changes: object) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_unknown_architecture(tiny_qwen3: str, tmp_path: os.PathLike) -> None:
    path = _copy(tiny_qwen3, tmp_path / "m")
    _rewrite_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: .*Qwen3ForCausalLM"):
        _load(path)


def test_missing_config_and_weight_files(tiny_qwen3: str, tmp_path: os.PathLike) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        _load(str(tmp_path))
    path = _copy(tiny_qwen3, tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no model.safetensors, model.safetensors.index.json or \*.safetensors"):
        _load(path)
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ModelLoadError, match="found pytorch_model.bin: only safetensors"):
        _load(path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}, f)
    with pytest.raises(ModelLoadError, match="shard file.*missing: model-00001-of-00001.safetensors"):
        _load(path)


def test_missing_and_unexpected_tensors_are_named(tiny_llama: str, tmp_path: os.PathLike) -> None:
    path = _copy(tiny_llama, tmp_path / "m")

    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.self_attn.k_proj.weight"]
        del t["lm_head.weight"]
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    _rewrite_weights(path, edit)
    with pytest.raises(ModelLoadError) as info:
        _load(path)
    msg = str(info.value)
    assert "2 missing tensors: " in msg and "model.layers.1.self_attn.k_proj.weight" in msg and "lm_head.weight" in msg
    assert "1 unexpected tensors: model.layers.0.self_attn.q_proj.bias (model.safetensors)" in msg


def test_shape_mismatch_names_tensor_and_shapes(tiny_qwen3: str, tmp_path: os.PathLike) -> None:
    path = _copy(tiny_qwen3, tmp_path / "m")
    _rewrite_config(path, intermediate_size=96)  # the weights were made for 128
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.gate_proj.weight \(model.safetensors\): checkpoint \(128, 64\), config expects \(96, 64\)"):
        _load(path)


def test_tied_checkpoint_with_extra_lm_head_is_accepted(tiny_qwen3: str, tmp_path: os.PathLike) -> None:
    """Some tied checkpoints also store lm_head.weight; HF ignores it in favour of the embedding."""
    path = _copy(tiny_qwen3, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.__setitem__("lm_head.weight", torch.zeros_like(t["model.embed_tokens.weight"])))
    model = _load(path)
    assert model.lm_head is None
    assert torch.count_nonzero(model.compute_logits(torch.ones(1, 64))) > 0
