"""The engine on CUDA (FlashInfer attention, CUDA-graph decode, bfloat16) against HF transformers
on CUDA in bfloat16, greedy, token for token, for both archs (the Llama family and the LFM2
hybrid). Skipped without CUDA or flashinfer.

Both sides round to bfloat16, but in different kernels, so logits differ by a few hundredths; a
divergence is tolerated only where HF's own top-2 gap at that step is at most NEAR_TIE (then the
continuations are different texts and the comparison of that prompt stops). Every other token
must match."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve  # noqa: E402
from common.engine.driver import EngineDriver  # noqa: E402
from common.engine.model_runner import ModelRunner  # noqa: E402
from common.engine.sampler import Sampler  # noqa: E402
from common.request import SamplingParams  # noqa: E402
from common.sched.stop import StopChecker  # noqa: E402
from tests.local_engine import LocalEngine  # noqa: E402
from tests.reference import hf_greedy, hf_teacher_forced  # noqa: E402

HEAD_DIM = 128
NEAR_TIE = 0.5  # logit units: two bf16 steps at |logits| of 32-64 (tiny models' logits have a std of ~8)
MAX_NEW = 16


def drift_against_fp32(model_dir: str, prompt: list[int], ours: list[int], hf_bf16: list[int]) -> str:
    """Both bf16 runs held to HF in float32 token by token (``hf_teacher_forced``): how far each
    one's choices fall below float32's argmax. Ours no worse than HF bf16's own says bf16 drift,
    far worse says a fault."""
    mine = hf_teacher_forced(model_dir, prompt, ours, torch.float32, "cuda")
    theirs = hf_teacher_forced(model_dir, prompt, hf_bf16, torch.float32, "cuda")
    return (f"against HF float32 (teacher-forced), the largest logit deficit of our tokens is {max(mine):.3f} "
            f"(steps over 0.01: {sum(d > 0.01 for d in mine)}), of HF bf16's {max(theirs):.3f} "
            f"(steps over 0.01: {sum(d > 0.01 for d in theirs)})")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "lfm2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_on_cuda(tiny_model_factory: Callable[..., str], arch: str, page_size: int) -> None:
    model_dir = tiny_model_factory(arch, head_dim=HEAD_DIM)
    cfg = resolve(NodeConfig(
        role="prefill",
        model=ModelConfig(model_path=model_dir, device="cuda", dtype="bfloat16"),
        cache=CacheConfig(page_size=page_size, max_total_tokens=16384, max_running_requests=16),
        attention=AttentionConfig(backend="flashinfer", cuda_graph_max_bs=8),
    ))
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    assert runner.graphs is not None  # decode batches of up to 8 replay graphs
    engine = LocalEngine(EngineDriver(runner, Sampler()), runner.memory, StopChecker(runner.arch.eos_token_ids),
                         chunk_size=48, max_prefill_tokens=192)
    rng = random.Random(page_size)
    vocab = runner.arch.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 33, 64, 130, 300)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(9)], shared + [rng.randrange(3, vocab)]]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, [greedy] * len(prompts))
    runner.memory.check_integrity()
    ties, matched = [], 0
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        want, gaps = hf_greedy(model_dir, prompt, MAX_NEW, dtype=torch.bfloat16, device="cuda")
        for step, (g, w) in enumerate(zip(res.output_ids, want)):
            if g != w:
                assert gaps[step] <= NEAR_TIE, (f"{arch} prompt {i} (len {len(prompt)}) diverges at step {step}: "
                                               f"got {g}, HF {w}, HF top-2 gap {gaps[step]:.3g}; "
                                               + drift_against_fp32(model_dir, prompt, res.output_ids, want))
                ties.append(f"prompt {i} step {step} gap {gaps[step]:.3f}")
                break
            matched += 1
    print(f"{arch} page {page_size}: {matched} tokens equal to HF bf16 on CUDA; near-ties: {ties or 'none'}")
    assert matched >= len(prompts) * MAX_NEW // 2
