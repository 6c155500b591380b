"""The tiny checkpoint maker: deterministic, loadable by HF offline, sane tokenizer and template."""
from __future__ import annotations

import filecmp
import json
import os
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open

from common.tools.make_tiny_model import ARCHS, main, make_tiny_model
from tests.reference import hf_greedy, hf_logits

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _auto_tokenizer(model_dir: str):  # noqa: ANN202 - transformers' tokenizer class varies by version
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_same_seed_gives_byte_identical_files(tmp_path: os.PathLike, tiny_qwen3: str) -> None:
    again = make_tiny_model(str(tmp_path / "again"), arch="qwen3", seed=0)
    for name in FILES:
        assert filecmp.cmp(os.path.join(tiny_qwen3, name), os.path.join(again, name), shallow=False), name


def test_other_seed_changes_weights_only(tmp_path: os.PathLike, tiny_qwen3: str) -> None:
    other = make_tiny_model(str(tmp_path / "other"), arch="qwen3", seed=1)
    assert not filecmp.cmp(os.path.join(tiny_qwen3, "model.safetensors"), os.path.join(other, "model.safetensors"), shallow=False)
    assert filecmp.cmp(os.path.join(tiny_qwen3, "tokenizer.json"), os.path.join(other, "tokenizer.json"), shallow=False)


def test_unknown_arch_is_a_clear_error(tmp_path: os.PathLike) -> None:
    with pytest.raises(ValueError, match=r"unknown tiny-model arch 'mistral'.*qwen3"):
        make_tiny_model(str(tmp_path / "x"), arch="mistral")
    assert not os.path.exists(tmp_path / "x")


def test_cli_writes_a_checkpoint(tmp_path: os.PathLike, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "cli")
    assert main(["--arch", "llama", "--seed", "3", out]) == 0
    assert capsys.readouterr().out.strip() == out
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_overrides_reach_config(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen3", num_hidden_layers=3, vocab_size=600)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 3
    assert cfg["vocab_size"] == 600
    assert len(_auto_tokenizer(path)) == 600


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_every_arch_and_config_is_as_advertised(tiny_model_factory: Callable[..., str], arch: str) -> None:
    path = tiny_model_factory(arch)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings == (arch != "llama")
    if arch == "llama":
        assert cfg.rope_parameters["rope_type"] == "llama3"
    # Every stored tensor was consumed (nothing silently left at HF's random init).
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor), name
    assert len(_auto_tokenizer(path)) == cfg.vocab_size


def test_generation_config_has_multiple_eos(tiny_qwen3: str) -> None:
    with open(os.path.join(tiny_qwen3, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    tok = _auto_tokenizer(tiny_qwen3)
    assert isinstance(eos, list) and len(eos) >= 2
    assert set(eos) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    "text",
    ["plain ascii", "emoji 😀🚀🤖 and ZWJ 👩‍👩‍👧", "中文你好，世界", "日本語 한국어", "\x00\t\n  odd \u200b spaces", "é" * 50],
)
def test_tokenizer_round_trips_utf8(tiny_qwen3: str, text: str) -> None:
    tok = _auto_tokenizer(tiny_qwen3)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and max(ids) < len(tok)
    assert tok.decode(ids) == text


def test_tokenizer_merges_common_text(tiny_qwen3: str) -> None:
    tok = _auto_tokenizer(tiny_qwen3)
    text = "The decode node reads the cache"
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) // 2


def test_special_tokens_are_single_ids(tiny_qwen3: str) -> None:
    tok = _auto_tokenizer(tiny_qwen3)
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert ids == [tok.convert_tokens_to_ids(t)]
        assert tok.decode(ids, skip_special_tokens=True) == ""


def test_chat_template_renders_chatml(tiny_qwen3: str) -> None:
    tok = _auto_tokenizer(tiny_qwen3)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 😀<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_has_clear_winners_and_does_not_collapse(tiny_model_factory: Callable[..., str], arch: str) -> None:
    """Weights are scaled so greedy decoding is a usable oracle: no near-ties, no stuck token."""
    tiny_model_dir = tiny_model_factory(arch)
    tok = _auto_tokenizer(tiny_model_dir)
    gaps: list[float] = []
    for prompt in ("Hello world", "中文 😀", "def forward(self):"):
        tokens, step_gaps = hf_greedy(tiny_model_dir, tok.encode(prompt), 64)
        assert len(tokens) == 64
        gaps += step_gaps
        assert len(set(tokens[-32:])) > 1, f"{prompt!r} collapsed to one repeated token"
    assert min(gaps) > 1e-4
    assert sorted(gaps)[len(gaps) // 2] > 0.5  # median gap


def test_hf_greedy_matches_uncached_argmax(tiny_llama: str) -> None:
    """The reference's cached loop agrees with a from-scratch forward over the whole sequence."""
    prompt = [5, 17, 42, 99, 3]
    tokens, gaps = hf_greedy(tiny_llama, prompt, 8)
    logits = hf_logits(tiny_llama, prompt + tokens[:-1])  # [T, vocab]
    tail = logits[len(prompt) - 1 :]  # [8, vocab]: the step predicting each new token
    assert tail.argmax(dim=-1).tolist() == tokens
    top2 = tail.topk(2, dim=-1).values
    assert torch.allclose(top2[:, 0] - top2[:, 1], torch.tensor(gaps), atol=1e-4)


def test_hf_teacher_forced_scores_greedy_tokens_zero_and_others_by_their_deficit(tiny_llama: str) -> None:
    from tests.reference import hf_teacher_forced

    prompt = [5, 17, 42, 99, 3]
    tokens, gaps = hf_greedy(tiny_llama, prompt, 6)
    assert max(hf_teacher_forced(tiny_llama, prompt, tokens)) < 1e-4
    runner_up = hf_logits(tiny_llama, prompt + tokens[:2])[-1].topk(2).indices[1].item()  # 2nd choice at step 3
    deficits = hf_teacher_forced(tiny_llama, prompt, tokens[:2] + [runner_up])
    assert abs(deficits[2] - gaps[2]) < 1e-4 and max(deficits[:2]) < 1e-4


def test_hf_greedy_stops_on_any_eos(tiny_llama: str) -> None:
    from tests.reference import generation_eos_ids

    eos = generation_eos_ids(tiny_llama)
    # Greedy decoding of this fixed model emits an EOS somewhere in its first 200 steps; cut the
    # prompt just before it so the very next step is the EOS.
    prompt = _auto_tokenizer(tiny_llama).encode("Numbers: 1 2 3")
    stream, _ = hf_greedy(tiny_llama, prompt, 200)
    at = next(i for i, t in enumerate(stream) if t in eos)
    tokens, _ = hf_greedy(tiny_llama, prompt + stream[:at], 10, stop_on_eos=True)
    assert tokens == [stream[at]]
    tokens, _ = hf_greedy(tiny_llama, prompt + stream[:at], 10, stop_on_eos=False)
    assert tokens[0] == stream[at] and len(tokens) == 10


def test_size_overrides_reach_config_and_hf_loads_them(tmp_path: os.PathLike) -> None:
    """The TP tests' model: 8 query / 4 KV heads, other sizes changed too, through the CLI."""
    out = str(tmp_path / "tp")
    argv = ["--arch", "llama", "--num-attention-heads", "8", "--num-key-value-heads", "4", "--hidden-size", "96",
            "--num-hidden-layers", "2", "--intermediate-size", "160", "--head-dim", "16", out]
    assert main(argv) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (8, 4, 96)
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.head_dim) == (2, 160, 16)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (4 * 16, 96)


# The real models' config.json values (from the hub), written out here independently of the tool.
_REAL = {
    "smollm2-135m": ("LlamaForCausalLM", dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                     num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True, head_dim=64), None),
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True), None),
    "llama-3.2-1b": ("LlamaForCausalLM", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True, head_dim=64), 500000.0),
}


@pytest.mark.parametrize("shape", sorted(_REAL))
def test_shape_presets_have_the_real_dimensions(tmp_path: os.PathLike, shape: str) -> None:
    """Config of the whole preset; weights written with one layer (an override wins over the
    preset) so the check stays small, and HF loads them with the preset's other dimensions."""
    from common.tools.make_tiny_model import tiny_config

    arch, dims, theta = _REAL[shape]
    cfg = tiny_config(shape=shape)
    assert cfg["architectures"] == [arch]
    assert {k: cfg[k] for k in dims} == dims
    if theta is not None:
        assert cfg["rope_theta"] == theta
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 32.0
    out = str(tmp_path / shape)
    assert main(["--shape", shape, "--num-hidden-layers", "1", "--dtype", "bfloat16", out]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == dims["hidden_size"]
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert len(_auto_tokenizer(out)) == model.config.vocab_size  # the tokenizer's size, not the real vocab
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


@pytest.mark.parametrize("argv,message", [
    (["--shape", "qwen3-0.6b", "--arch", "llama"], "--shape qwen3-0.6b is a qwen3 model, not --arch llama"),
    (["--num-attention-heads", "6", "--num-key-value-heads", "4"], "not a multiple of num_key_value_heads 4"),
    (["--script", "a", "--script", "a"], "--script needs distinct non-empty chunks"),
    (["--arch", "lfm2", "--script", "a"], "an attention-only arch (not lfm2)"),
])
def test_bad_options_exit_2_and_write_nothing(tmp_path: os.PathLike, capsys: pytest.CaptureFixture[str],
                                               argv: list[str], message: str) -> None:
    out = str(tmp_path / "bad")
    with pytest.raises(SystemExit) as exc:
        main([*argv, out])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(out)
