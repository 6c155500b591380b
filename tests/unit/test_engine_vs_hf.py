"""Acceptance for the engine core: greedy generation through our engine (paged KV, chunked
prefill, prefix cache, batched decode) equals HF transformers greedy, token for token.

A divergence is tolerated only where the reference's top-2 logit gap at that step is a
near-tie; the test reports every such case.
"""
from __future__ import annotations

import random

import pytest
import torch

from common import kernels
from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve
from common.engine.driver import EngineDriver
from tests.local_engine import LocalEngine
from common.engine.model_runner import ModelRunner
from common.engine.sampler import Sampler
from common.request import SamplingParams
from common.sched.stop import StopChecker
from tests.reference import hf_greedy

NEAR_TIE = 1e-3
MAX_NEW = 12


def build_engine(model_dir: str, page_size: int, chunk: int, total_tokens: int = 8192,
                 mirror_mib: int = AttentionConfig.torch_decode_mirror_mib,
                 cpu_linear: str = ModelConfig.cpu_linear) -> tuple[LocalEngine, ModelRunner]:
    cfg = resolve(NodeConfig(
        role="prefill",
        model=ModelConfig(model_path=model_dir, device="cpu", dtype="float32", cpu_linear=cpu_linear),
        cache=CacheConfig(page_size=page_size, max_total_tokens=total_tokens, max_running_requests=32),
        attention=AttentionConfig(backend="torch", torch_decode_mirror_mib=mirror_mib),
    ))
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    engine = LocalEngine(EngineDriver(runner, Sampler()), runner.memory, StopChecker(runner.arch.eos_token_ids),
                         chunk_size=chunk, max_prefill_tokens=chunk * 4)
    return engine, runner


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 120, 200, 300]
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a common prefix for two prompts
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prompts[4] = shared + prompts[4]
    prompts[6] = shared + prompts[6]
    return prompts


def compare(model_dir: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[str]:
    """Returns near-tie reports; fails on any real divergence."""
    ties: list[str] = []
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        want, gaps = hf_greedy(model_dir, prompt, MAX_NEW)
        for step, (g, w) in enumerate(zip(got, want)):
            if g != w:
                assert gaps[step] < NEAR_TIE, (
                    f"prompt {i} (len {len(prompt)}) diverges at step {step}: got {g}, HF {w}, top-2 gap {gaps[step]:.3g}"
                )
                ties.append(f"prompt {i} step {step}: near-tie gap {gaps[step]:.2e}")
                break  # after a legitimate tie the continuations are different texts
        else:
            assert len(got) == len(want) == MAX_NEW
    return ties


@pytest.mark.parametrize("page_size,chunk,mirror_mib,cpu_linear",
                         [(1, 32, 1024, "auto"), (16, 48, 1024, "auto"), (16, 48, 0, "auto"),
                          (1, 32, 1024, "packed"), (16, 48, 0, "packed"), (16, 48, 1024, "native"),
                          (16, 48, 1024, "plain")])
def test_greedy_matches_hf(tiny_model_dir: str, page_size: int, chunk: int, mirror_mib: int, cpu_linear: str) -> None:
    """mirror_mib 0: decode gathers K/V from the pages (the torch backend's path without the
    decode mirror); otherwise decode reads the mirror. cpu_linear: our kernel's layout (auto, where
    it builds, and native: with the mirror each decode step is one call of the whole-step kernel),
    oneDNN-packed projections, or MKL's plain ones (the layers one by one over the mirror)."""
    torch.manual_seed(0)
    engine, runner = build_engine(tiny_model_dir, page_size, chunk, mirror_mib=mirror_mib, cpu_linear=cpu_linear)
    assert (runner.attn_backend.mirror is None) == (mirror_mib == 0)
    ours = kernels.linear() is not None  # auto packs every projection for our kernel where it builds
    assert (runner.packed_linears > 0) == (cpu_linear in ("packed", "native") or (cpu_linear == "auto" and ours))
    assert not runner.splits_well  # a tiny model's forward is too short to spread over cores
    if kernels.decode_step() is not None:  # our projections, over the mirror: each decode step is one call of our kernel
        assert (runner.native_decode is not None) == (cpu_linear in ("auto", "native") and mirror_mib > 0)
    prompts = make_prompts(runner.arch.vocab_size, seed=page_size)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    first = engine.generate(prompts, [greedy] * len(prompts))
    runner.memory.check_integrity()
    ties = compare(tiny_model_dir, prompts, [r.output_ids for r in first])

    # Second pass: the same prompts again hit the prefix cache (every full page of each prompt).
    second = engine.generate(prompts, [greedy] * len(prompts))
    runner.memory.check_integrity()
    for p, r in zip(prompts, second):
        assert r.cached_tokens == ((len(p) - 1) // page_size) * page_size
    assert [r.output_ids for r in second] == [r.output_ids for r in first]
    if ties:
        print("near-ties:", *ties, sep="\n  ")

    stats = runner.memory.stats()
    assert stats["free_req_slots"] == stats["total_req_slots"]
    assert stats["used_pages"] == 0, stats


def test_stops_on_any_eos_and_max_tokens(tiny_qwen3: str) -> None:
    engine, runner = build_engine(tiny_qwen3, 16, 64)
    prompts = make_prompts(runner.arch.vocab_size, seed=3)[:6]
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)] * len(prompts))
    eos = set(runner.arch.eos_token_ids)
    assert len(eos) >= 2
    for p, r in zip(prompts, results):
        want, _ = hf_greedy(tiny_qwen3, p, MAX_NEW, stop_on_eos=True)
        assert r.output_ids == want
        if r.output_ids[-1] in eos:
            assert r.finish is not None and r.finish.type == "stop"
        else:
            assert r.finish is not None and r.finish.type == "length" and len(r.output_ids) == MAX_NEW
    runner.memory.check_integrity()


@pytest.mark.parametrize("page_size,chunk,cpu_linear", [(1, 7, "auto"), (16, 48, "packed"), (16, 48, "native")])
def test_hybrid_greedy_matches_hf(tiny_lfm2: str, page_size: int, chunk: int, cpu_linear: str) -> None:
    """LFM2: the conv layers' state is carried across prefill chunks (chunk 7 splits every prompt
    longer than 7 tokens, mid-page too) and updated in place by batched decode; slots are reused
    by the second pass, so a slot not reset on reuse would show as a divergence there."""
    engine, runner = build_engine(tiny_lfm2, page_size, chunk, cpu_linear=cpu_linear)
    assert (runner.packed_linears > 0) == (cpu_linear in ("packed", "native") or (cpu_linear == "auto" and kernels.linear() is not None))
    assert runner.state_pool is not None and not runner.memory.cache.enabled
    prompts = make_prompts(runner.arch.vocab_size, seed=page_size + 10)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    first = engine.generate(prompts, [greedy] * len(prompts))
    runner.memory.check_integrity()
    ties = compare(tiny_lfm2, prompts, [r.output_ids for r in first])
    second = engine.generate(prompts[::-1], [greedy] * len(prompts))
    assert [r.cached_tokens for r in second] == [0] * len(prompts), "no prefix cache for a stateful model"
    assert [r.output_ids for r in second[::-1]] == [r.output_ids for r in first]
    if ties:
        print("near-ties:", *ties, sep="\n  ")

    runner.memory.check_integrity()
    stats = runner.memory.stats()
    assert stats["free_state_slots"] == stats["total_state_slots"] == stats["total_req_slots"]
    assert stats["free_req_slots"] == stats["total_req_slots"] and stats["used_pages"] == 0, stats


def test_greedy_matches_hf_with_attention_in_small_query_blocks(tiny_model_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts and chunked prefill's later chunks past a cached prefix, their causal attention run
    in query blocks merged by log-sum-exps (torch_backend.ATTN_BLOCK, lowered to 5 so every
    prompt takes that path, with short last blocks)."""
    from common.attention import torch_backend

    monkeypatch.setattr(torch_backend, "ATTN_BLOCK", 5)
    engine, runner = build_engine(tiny_model_dir, 16, 48)
    prompts = make_prompts(runner.arch.vocab_size, seed=21)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, [greedy] * len(prompts))
    runner.memory.check_integrity()
    compare(tiny_model_dir, prompts, [r.output_ids for r in results])
