"""The independent oracle: Hugging Face ``transformers`` in float32 on CPU.

``hf_greedy`` runs HF's own model with its own KV cache, one token per step exactly as greedy
``generate`` does, and also reports each step's top-2 logit gap so a mismatch against our
engine can be classified as a near-tie (gap tiny) or a real bug (gap large).
"""
from __future__ import annotations

import functools
import json
import os

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """The HF model for ``model_dir`` (float32 on CPU unless asked otherwise: the GPU tests compare
    in bfloat16 on CUDA); cached per arguments; tests must not mutate it."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars flood test logs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device)
    model.eval()
    return model


def generation_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json (falls back to config.json), always a list."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [int(eos)]
    return []


@torch.inference_mode()
def hf_logits(model_dir: str, input_ids: list[int]) -> torch.Tensor:
    """Float32 logits of every position of one sequence, no cache. [len(input_ids), vocab]"""
    model = hf_model(model_dir)
    out = model(input_ids=torch.tensor([input_ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()  # [T, vocab]


@torch.inference_mode()
def hf_greedy(
    model_dir: str, prompt_ids: list[int], max_new_tokens: int, stop_on_eos: bool = False,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> tuple[list[int], list[float]]:
    """Greedy continuation of ``prompt_ids`` and the top-2 logit gap at each step.

    ``stop_on_eos=False`` behaves like ``ignore_eos``: EOS tokens are emitted and decoding goes
    on. With ``stop_on_eos=True`` the EOS token (any id of generation_config's list) is kept as
    the last output token, as HF ``generate`` does.
    """
    from transformers import DynamicCache

    if not prompt_ids:
        raise ValueError("hf_greedy needs a non-empty prompt")
    model = hf_model(model_dir, dtype, device)
    eos = set(generation_eos_ids(model_dir)) if stop_on_eos else set()
    cache = DynamicCache(config=model.config)
    step_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, cache=cache, use_cache=True)  # transformers >= 5.2x: ``cache``
        cache = out.cache
        logits = out.logits[0, -1].float()  # [vocab]
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        if nxt in eos:
            break
        step_ids = torch.tensor([[nxt]], dtype=torch.long, device=device)  # [1, 1]
    return tokens, gaps


def grammar_matcher(model_dir: str, kind: str, text: str):  # type: ignore[no-untyped-def]
    """A fresh llguidance matcher for a grammar over the model's tokenizer, built straight from
    tokenizer.json with llguidance's own calls (none of pdcluster's grammar code)."""
    import llguidance as llg

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok_json = f.read()
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    lt = llg.LLTokenizer(tok_json, n_vocab=vocab, eos_token=generation_eos_ids(model_dir))
    if kind == "json_schema":
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    elif kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(text)
    else:
        grammar = llg.grammar_from("ebnf", text)
    m = llg.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


@torch.inference_mode()
@torch.inference_mode()
def hf_teacher_forced(model_dir: str, prompt_ids: list[int], output_ids: list[int], dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> list[float]:
    """How far each token of ``output_ids`` is from HF's greedy choice given the tokens before it:
    ``max logit - logit of output_ids[i]`` after ``prompt_ids + output_ids[:i]`` (0 where it is the
    argmax), from one forward without cache. Unlike a free-running ``hf_greedy`` it does not
    compound: a bf16 engine can be held to HF in float32 step by step."""
    model = hf_model(model_dir, dtype, device)
    ids = torch.tensor([prompt_ids + output_ids[:-1]], dtype=torch.long, device=device)  # [1, P + O - 1]
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 :].float()  # [O, vocab]
    chosen = logits.gather(1, torch.tensor(output_ids, device=device)[:, None])[:, 0]  # [O]
    return (logits.max(dim=-1).values - chosen).tolist()


def hf_greedy_constrained(model_dir: str, prompt_ids: list[int], max_new_tokens: int, kind: str,
                          text: str) -> tuple[list[int], list[float]]:
    """HF ``generate`` (greedy) with the grammar applied as a logits processor, and the top-2 gap
    of the masked logits at each step. The trailing EOS HF emits once the grammar is complete is
    dropped: pdcluster ends the request at that point (finish_reason stop) without sampling it."""
    import numpy as np
    from transformers import LogitsProcessor, LogitsProcessorList

    matcher = grammar_matcher(model_dir, kind, text)
    vocab = hf_model(model_dir).config.vocab_size
    gaps: list[float] = []

    class GrammarProcessor(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            new = input_ids[0, len(prompt_ids):].tolist()
            if new:
                assert matcher.consume_token(new[-1]), matcher.get_error()
            raw = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)  # bit t % 8 of byte t // 8: token t
            allowed = torch.from_numpy(np.unpackbits(raw, bitorder="little")[:vocab].astype(bool))
            masked = scores.masked_fill(~allowed[None, : scores.shape[1]], float("-inf"))
            top2 = torch.topk(masked[0], 2).values
            gaps.append(float(top2[0] - top2[1]))
            return masked

    model = hf_model(model_dir)
    eos = generation_eos_ids(model_dir)
    out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                         logits_processor=LogitsProcessorList([GrammarProcessor()]))
    tokens = out[0, len(prompt_ids):].tolist()
    if tokens and tokens[-1] in eos:
        tokens.pop()
    return tokens, gaps
