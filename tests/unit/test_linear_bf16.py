"""``--cpu-linear bf16``: bfloat16 projections with everything else in float32, held to HF run in
bfloat16 (common/models/linear.py).

The path is not HF-exact by design, so the oracle is HF's own reduced-precision error: on the
same prompts, our logits must be no further from HF float32 than HF bfloat16's are (with 50 %
slack, and not identical: the path must really round), and every greedy token we generate must
be one HF float32 could have picked within that error (teacher-forced: HF float32's best logit
minus the logit of our token, given our earlier tokens, at most twice the error bound: a token
whose logit is off by at most e can only beat one at most 2e above it). The first test pins the
linear itself to the product of the rounded operands; a 3 % error in every projection already
fails the logits check (tried on the tiny llama).

These run on any CPU with oneDNN: where the CPU lacks AVX512-BF16 / AMX, oneDNN emulates the
instructions (slower, same rounding), so the numerics are checked on every CI machine.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from common.engine.forward_batch import ForwardMode
from common.models.linear import linear, pack_linears, resolve_mode
from common.request import SamplingParams
from tests.reference import hf_logits, hf_model, hf_teacher_forced
from tests.unit.test_engine_vs_hf import build_engine
from tests.unit.test_models import Harness

SLACK = 1.5


class Proj(nn.Module):
    PACKED_LINEARS = ("proj",)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_bf16_linear_is_the_bfloat16_product_returned_in_float32(rows: int) -> None:
    """Any row count (exact, padded, chunked): float32 in and out, the product of the bfloat16
    roundings of input and weight summed in float32 (to the output's bfloat16 rounding), bias in
    float32 after it."""
    torch.manual_seed(rows)
    weight = torch.randn(48, 32)
    layer = Proj(weight.clone())
    bias = torch.randn(48)
    assert pack_linears(layer, dtype=torch.bfloat16) == 1
    assert layer.proj.is_mkldnn and layer.proj.dtype == torch.bfloat16
    x = torch.randn(rows, 32)
    got = linear(x, layer.proj, bias)
    want = x.bfloat16().float() @ weight.bfloat16().float().t()  # [rows, 48], float32 sums of the rounded operands
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    torch.testing.assert_close(got - bias, want, rtol=2**-7, atol=1e-4)  # the output's own rounding to bfloat16
    assert (got - bias - x @ weight.t()).abs().max() > 1e-4  # and it did round: not the float32 product


def test_bf16_mode_is_chosen_only_when_asked(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_mode("auto", "cpu", torch.float32) == "auto"  # auto never trades precision
    assert resolve_mode("bf16", "cpu", torch.float32) == "bf16"
    with pytest.raises(ValueError, match="bf16 needs a CPU model in float32"):
        resolve_mode("bf16", "cpu", torch.bfloat16)
    monkeypatch.setattr("common.models.linear.cpu_isa", lambda: {"bf16": False})
    with caplog.at_level(logging.WARNING, logger="common.models.linear"):
        assert resolve_mode("bf16", "cpu", torch.float32) == "bf16"
    assert "neither AVX512-BF16 nor AMX-BF16" in caplog.text


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 37, 120)]


def test_bf16_projections_stay_within_hf_bfloat16s_error(tiny_model_dir: str) -> None:
    engine, runner = build_engine(tiny_model_dir, page_size=16, chunk=48, cpu_linear="bf16")
    assert runner.packed_linears > 0  # every projection, however small
    prompts = _prompts(runner.arch.vocab_size)
    hf16 = hf_model(tiny_model_dir, torch.bfloat16)
    ours_err = hf_err = 0.0
    for prompt in prompts:
        want = hf_logits(tiny_model_dir, prompt)[-1]  # [vocab] float32 reference
        with torch.inference_mode():
            hf16_last = hf16(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, -1].float()
        ours = Harness(runner.model, max_reqs=1, max_ctx=128).step(ForwardMode.EXTEND, [(0, prompt, 0)])[0]
        ours_err = max(ours_err, float((ours - want).abs().max()))
        hf_err = max(hf_err, float((hf16_last - want).abs().max()))
    assert 0 < ours_err <= SLACK * hf_err, f"ours {ours_err:.3g} against HF bfloat16's {hf_err:.3g}"

    # Greedy through the engine (paged KV, chunked prefill, batched decode): each token is one HF
    # float32 could pick within that error.
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [r.output_ids for r in engine.generate(prompts, [greedy] * len(prompts))]
    runner.memory.check_integrity()
    bound = 2 * SLACK * hf_err
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 12
        regret = hf_teacher_forced(tiny_model_dir, prompt, out)
        assert max(regret) <= bound, f"prompt of {len(prompt)}: a token {max(regret):.3g} below HF's best (bound {bound:.3g})"
