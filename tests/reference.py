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
def hf_model(model_dir: str) -> torch.nn.Module:
    """The HF float32 model for ``model_dir`` (cached per directory; tests must not mutate it)."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars flood test logs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
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
    model_dir: str, prompt_ids: list[int], max_new_tokens: int, stop_on_eos: bool = False
) -> tuple[list[int], list[float]]:
    """Greedy continuation of ``prompt_ids`` and the top-2 logit gap at each step.

    ``stop_on_eos=False`` behaves like ``ignore_eos``: EOS tokens are emitted and decoding goes
    on. With ``stop_on_eos=True`` the EOS token (any id of generation_config's list) is kept as
    the last output token, as HF ``generate`` does.
    """
    from transformers import DynamicCache

    if not prompt_ids:
        raise ValueError("hf_greedy needs a non-empty prompt")
    model = hf_model(model_dir)
    eos = set(generation_eos_ids(model_dir)) if stop_on_eos else set()
    cache = DynamicCache(config=model.config)
    step_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
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
        step_ids = torch.tensor([[nxt]], dtype=torch.long)  # [1, 1]
    return tokens, gaps
