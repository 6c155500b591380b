"""Tensor parallelism end to end in the engine: N rank processes (gloo over loopback), each with
its shard of the weights and a KV pool of its own KV heads, generate greedily what HF
transformers generates, agree with each other token for token, and hold exactly the matching
heads of the TP=1 engine's K/V.

Model: make-tiny-model with 8 query heads (4 or 2 KV heads), so TP=2 splits KV heads and TP=4
over 2 KV heads replicates each KV head on two ranks.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from common.models.sharding import attention_shard
from common.request import SamplingParams
from tests.tp_harness import MAX_NEW, build, prefill_kv, run_tp
from tests.unit.test_engine_vs_hf import compare, make_prompts

# Layer 0's K/V are the same dot products on both sides (bit-equal in practice); later layers
# read the all-reduced residual, whose summation order differs from one full-width matmul.
LAYER0_TOL = 1e-6
LATER_TOL = 1e-4


def _check(model_dir: str, tp: int) -> None:
    engine, runner = build(model_dir)  # TP=1: the K/V reference
    arch = runner.arch
    prompts = make_prompts(arch.vocab_size, seed=tp)[:8]  # lengths 1 .. 120, two sharing a prefix
    kv_prompt = prompts[7][:40]
    k1, v1 = prefill_kv(runner, kv_prompt)

    ranks = run_tp(model_dir, tp, prompts, kv_prompt)

    # Every rank appended the same tokens (rank 0's are authoritative, the others must agree).
    assert all(r.outputs == ranks[0].outputs for r in ranks)
    ties = compare(model_dir, prompts, ranks[0].outputs)
    if ties:
        print("near-ties:", *ties, sep="\n  ")
    # The TP=1 engine on the same prompts: same tokens (a sanity check of the reference itself).
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    tp1 = [r.output_ids for r in engine.generate(prompts, [greedy] * len(prompts))]
    assert tp1 == ranks[0].outputs or ties

    for r in ranks:
        want = attention_shard(arch.num_heads, arch.num_kv_heads, tp, r.rank)
        assert (r.q_head_start, r.num_heads, r.kv_head_start, r.num_kv_heads) == (
            want.q_head_start, want.num_heads, want.kv_head_start, want.num_kv_heads)
        assert r.kv_pool_heads == want.num_kv_heads  # the pool holds this rank's heads only
        heads = slice(r.kv_head_start, r.kv_head_start + r.num_kv_heads)
        for layer, (k, v) in enumerate(zip(r.k, r.v)):
            tol = LAYER0_TOL if layer == 0 else LATER_TOL
            assert k.shape == k1[layer][:, heads].shape
            torch.testing.assert_close(k, k1[layer][:, heads], rtol=tol, atol=tol, msg=f"rank {r.rank} layer {layer} K")
            torch.testing.assert_close(v, v1[layer][:, heads], rtol=tol, atol=tol, msg=f"rank {r.rank} layer {layer} V")


@pytest.mark.parametrize("arch,extra", [("qwen3", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_tp2_greedy_matches_hf_and_holds_half_the_kv_heads(tiny_model_factory: Callable[..., str], arch: str,
                                                            extra: dict) -> None:
    """qwen3: q/k norms, tied head; llama: untied head, llama3 RoPE and biases on every projection,
    o/down biases added once after the all-reduce."""
    _check(tiny_model_factory(arch, num_attention_heads=8, num_key_value_heads=4, **extra), tp=2)


def test_tp4_replicates_kv_heads(tiny_model_factory: Callable[..., str]) -> None:
    _check(tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=2), tp=4)


def test_tp2_sampled_requests_agree_on_every_rank(tiny_model_factory: Callable[..., str]) -> None:
    """Unseeded sampling draws from a generator each rank seeds from the OS: without rank 0's ids
    broadcast, the ranks would append different tokens and their KV would part ways."""
    path = tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=4)
    prompts = make_prompts(1000, seed=5)[:6]
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=1.5, ignore_eos=True),
              SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, ignore_eos=True),
              SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)] * 2
    ranks = run_tp(path, 2, prompts, prompts[3][:8], params)
    assert ranks[0].outputs == ranks[1].outputs
    assert all(len(o) == MAX_NEW for o in ranks[0].outputs)
