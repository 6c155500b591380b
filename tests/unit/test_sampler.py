"""Sampler: each filter and penalty against an independent reference (numpy loops, HF processors),
greedy == argmax, seeded sampling reproducible and batch-independent, empirical distribution of
sampling matches the target distribution (chi-square with a fixed sample size)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.engine import sampler as sampler_mod
from common.engine.sampler import Sampler, apply_penalties, filter_probs, step_seed
from common.request import MAX_TOP_K, SamplingParams

V = 40


def _logits(bsz: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(bsz, vocab, generator=torch.Generator().manual_seed(seed)) * scale  # [B, V]


# ----------------------------------------------------------------------------- references


def ref_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """HF order, float64, one row, written as plain loops over a descending ranking."""
    x = logits.astype(np.float64) / temperature
    n = len(x)
    rank = sorted(range(n), key=lambda i: -x[i])
    keep = [True] * n
    if 0 < top_k < n:
        kth = x[rank[top_k - 1]]
        for i in range(n):
            if x[i] < kth:
                keep[i] = False

    def probs_of(keep: list[bool]) -> np.ndarray:
        m = max(x[i] for i in range(n) if keep[i])
        e = np.array([math.exp(x[i] - m) if keep[i] else 0.0 for i in range(n)])
        return e / e.sum()

    if top_p < 1.0:
        p = probs_of(keep)
        before = 0.0
        for i in rank:
            if not keep[i]:
                continue
            if before >= top_p:
                keep[i] = False
            before += p[i]
    if min_p > 0.0:
        p = probs_of(keep)
        top = max(p)
        for i in range(n):
            if keep[i] and p[i] < min_p * top:
                keep[i] = False
    return probs_of(keep)


def hf_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The same chain with transformers' own warpers (second, independent reference)."""
    scores = logits[None].clone()  # [1, V]
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the categories with positive expected mass, and its dof."""
    total = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    exp = probs[support] * total
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# 0.9999 quantiles of chi-square (p = 1e-4): a correct sampler fails once in 10^4 seeds, and every
# test uses a fixed seed, so these never flake.
CHI2_CRIT = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 7: 29.88, 9: 33.72}


# ----------------------------------------------------------------------------- filters


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, -1, 0.8, 0.0),
        (1.0, -1, 1.0, 0.2),
        (0.5, 10, 0.9, 0.05),
        (2.0, 3, 0.5, 0.3),
        (1.0, V + 7, 0.95, 0.0),  # top_k above the vocabulary is "off"
    ],
)
def test_filter_probs_matches_numpy_and_hf(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    logits = _logits(6, seed=11)
    bsz = logits.shape[0]
    k = top_k if 0 < top_k < V else V
    probs = filter_probs(
        logits,
        temperature=torch.full((bsz,), temperature),
        top_k=torch.full((bsz,), k, dtype=torch.int64),
        top_p=torch.full((bsz,), top_p),
        min_p=torch.full((bsz,), min_p),
    )  # [B, V]
    for b in range(bsz):
        ref = ref_filter(logits[b].numpy(), temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(probs[b].numpy(), ref, atol=1e-6)
        hf = hf_filter(logits[b], temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(probs[b].numpy(), hf.numpy(), atol=1e-6)
        assert (probs[b] > 0).sum() >= 1


def test_filter_probs_mixed_rows_match_each_row_alone() -> None:
    logits = _logits(4, seed=5)
    temps = torch.tensor([0.6, 1.0, 1.5, 0.9])
    ks = torch.tensor([V, 4, 12, V])
    ps = torch.tensor([0.85, 1.0, 0.7, 1.0])
    mps = torch.tensor([0.0, 0.1, 0.0, 0.25])
    probs = filter_probs(logits, temps, ks, ps, mps)
    for b in range(4):
        ref = ref_filter(logits[b].numpy(), float(temps[b]), int(ks[b]), float(ps[b]), float(mps[b]))
        np.testing.assert_allclose(probs[b].numpy(), ref, atol=1e-6)


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0]])
    probs = filter_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1), torch.zeros(1))
    hf = hf_filter(logits[0], 1.0, 2, 1.0, 0.0)
    np.testing.assert_allclose(probs[0].numpy(), hf.numpy(), atol=1e-7)
    assert (probs[0] > 0).tolist() == [True, False, True, False, True, False]


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_hf_processor() -> None:
    logits = _logits(3, seed=2)
    prompts = [[1, 2, 3, 3], [5, 6], [7]]
    outputs = [[4, 1], [6, 6, 9], []]
    penalties = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    got = apply_penalties(logits, params, outputs, prompts)
    for b in range(3):
        ids = torch.tensor([prompts[b] + outputs[b]])
        ref = RepetitionPenaltyLogitsProcessor(penalties[b])(ids, logits[b : b + 1].clone())
        torch.testing.assert_close(got[b], ref[0])
    assert not torch.equal(got, logits)  # the inputs do hit both signs of logits


def test_frequency_presence_penalties_match_numpy_loop() -> None:
    logits = _logits(3, seed=3)
    prompts = [[0, 1, 2], [3], [4, 4]]
    outputs = [[2, 2, 5, 7, 2], [3, 3], [8]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.0),
        SamplingParams(frequency_penalty=-0.3, presence_penalty=1.2),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=-0.5),
    ]
    got = apply_penalties(logits, params, outputs, prompts).numpy()
    for b, p in enumerate(params):
        ref = logits[b].numpy().astype(np.float64).copy()
        seen = set(prompts[b]) | set(outputs[b])
        for t in seen:  # HF repetition penalty over prompt + output
            ref[t] = ref[t] / p.repetition_penalty if ref[t] > 0 else ref[t] * p.repetition_penalty
        for t in set(outputs[b]):  # OpenAI: output tokens only
            ref[t] -= p.frequency_penalty * outputs[b].count(t) + p.presence_penalty
        np.testing.assert_allclose(got[b], ref, rtol=1e-6, atol=1e-6)
    # prompt-only tokens are not touched by frequency/presence
    assert got[0][0] == pytest.approx(float(logits[0][0]))


def test_repetition_penalty_needs_prompt_ids() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        Sampler(seed=0).sample(_logits(1), [SamplingParams(repetition_penalty=1.2)], [[1]])


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_and_top_k_one() -> None:
    logits = _logits(8, seed=4)
    params = [SamplingParams(temperature=0.0) if b % 2 else SamplingParams(top_k=1, temperature=1.7) for b in range(8)]
    out = Sampler(seed=0).sample(logits, params, [[] for _ in range(8)])
    assert out.token_ids.tolist() == np.argmax(logits.numpy(), axis=-1).tolist()


def test_tiny_temperature_is_greedy_not_nan() -> None:
    # 1e-50 is 0.0 in float32: dividing by it gave NaN probabilities and always token 0.
    logits = _logits(6, seed=11)
    logits[:, 0] = -10.0  # token 0 is never the argmax, so a NaN row cannot pass by luck
    temps = [1e-50, 1e-30, 1e-6, 0.0, 1e-50, 9e-6]
    params = [SamplingParams(temperature=t, seed=3 if b % 2 else None) for b, t in enumerate(temps)]
    assert all(p.is_greedy for p in params)
    mixed = params + [SamplingParams(temperature=1.0)]  # one sampled row: the mixed path runs too
    rows = torch.cat([logits, _logits(1, seed=12)])  # [7, V]
    out = Sampler(seed=0).sample(rows, mixed, [[] for _ in mixed])
    assert out.token_ids.tolist()[:6] == np.argmax(logits.numpy(), axis=-1).tolist()
    assert not SamplingParams(temperature=1e-5).is_greedy  # the boundary itself samples


def test_top_k_at_its_bound_is_no_filter() -> None:
    # The API accepts top_k up to MAX_TOP_K; anything at or above the vocabulary means "off".
    logits = _logits(4, seed=13)
    out = [Sampler(seed=0).sample(logits, [SamplingParams(top_k=k, seed=b) for b in range(4)], [[]] * 4)
           for k in (MAX_TOP_K, -1, V)]
    assert out[0].token_ids.tolist() == out[1].token_ids.tolist() == out[2].token_ids.tolist()


def test_greedy_with_repetition_penalty_equals_hf_greedy_step() -> None:
    # Make the argmax a repeated token so the penalty changes the choice.
    logits = _logits(1, seed=6)
    top = int(logits[0].argmax())
    prompt, output = [top, 3], [top]
    proc = RepetitionPenaltyLogitsProcessor(5.0)(torch.tensor([prompt + output]), logits.clone())
    out = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=5.0)], [output], [prompt])
    assert out.token_ids.tolist() == [int(proc[0].argmax())]
    assert int(proc[0].argmax()) != top


def test_all_greedy_batch_skips_filtering(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("filter_probs called for an all-greedy batch")

    monkeypatch.setattr(sampler_mod, "filter_probs", boom)
    logits = _logits(3, seed=7)
    out = Sampler(seed=0).sample(logits, [SamplingParams(temperature=0.0)] * 3, [[], [], []])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


# ----------------------------------------------------------------------------- distributions


def test_temperature_sampling_matches_softmax_chi_square() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])  # [6]
    n = 20000
    params = [SamplingParams(temperature=0.7)] * n
    out = Sampler(seed=123).sample(logits.expand(n, -1).contiguous(), params, [[] for _ in range(n)])
    counts = np.bincount(out.token_ids.numpy(), minlength=6)
    target = torch.softmax(logits / 0.7, dim=-1).numpy().astype(np.float64)
    stat, dof = chi_square(counts, target)
    assert stat < CHI2_CRIT[dof], (stat, counts)
    # The test has power: the same counts are far from the untempered distribution.
    wrong, _ = chi_square(counts, torch.softmax(logits, dim=-1).numpy().astype(np.float64))
    assert wrong > 10 * CHI2_CRIT[dof]


def test_filtered_seeded_sampling_matches_reference_distribution() -> None:
    # One row per seed: also checks that seeded draws are unbiased across seeds.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.7, 1.2])  # [10]
    n = 4000
    params = [SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.1, seed=s) for s in range(n)]
    out = Sampler(seed=0).sample(logits.expand(n, -1).contiguous(), params, [[] for _ in range(n)])
    counts = np.bincount(out.token_ids.numpy(), minlength=10)
    target = ref_filter(logits.numpy(), 1.2, 6, 0.9, 0.1)
    stat, dof = chi_square(counts, target)
    assert dof >= 2
    assert stat < CHI2_CRIT[dof], (stat, counts, target)


# ----------------------------------------------------------------------------- seeds


def _run_steps(sampler: Sampler, rows: list[tuple[torch.Tensor, SamplingParams]], steps: int) -> list[list[int]]:
    """Decode ``steps`` tokens for every row together; row logits are fixed per step."""
    outputs: list[list[int]] = [[] for _ in rows]
    for step in range(steps):
        logits = torch.stack([lg[step] for lg, _ in rows])  # [B, V]
        out = sampler.sample(logits, [p for _, p in rows], outputs)
        for i, t in enumerate(out.token_ids.tolist()):
            outputs[i].append(t)
    return outputs


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    steps = 12
    flat = torch.zeros(steps, V)  # uniform: any difference in noise changes the token
    seeded = (flat, SamplingParams(temperature=1.0, seed=42))
    alone = _run_steps(Sampler(seed=1), [seeded], steps)[0]
    again = _run_steps(Sampler(seed=999), [seeded], steps)[0]
    assert alone == again
    neighbours = [
        (_logits(steps, seed=8), SamplingParams(temperature=0.8)),
        (_logits(steps, seed=9), SamplingParams(temperature=0.0)),
        (flat, SamplingParams(temperature=1.0, seed=7)),
        (_logits(steps, seed=10), SamplingParams(top_k=3, seed=42)),
    ]
    for pos in range(len(neighbours) + 1):
        rows = neighbours[:pos] + [seeded] + neighbours[pos:]
        assert _run_steps(Sampler(seed=pos), rows, steps)[pos] == alone
    other = _run_steps(Sampler(seed=1), [(flat, SamplingParams(temperature=1.0, seed=43))], steps)[0]
    assert other != alone
    assert len(set(alone)) > 3  # the step is mixed into the seed: not the same draw every step


def test_seed_stream_depends_only_on_seed_and_step() -> None:
    # Resuming at step 5 (e.g. on the decode node after the prefill node sampled steps 0..4)
    # gives the same token as a run that went through steps 0..4 itself.
    logits = torch.zeros(1, V)
    p = SamplingParams(seed=2024)
    full = _run_steps(Sampler(seed=0), [(torch.zeros(8, V), p)], 8)[0]
    resumed = Sampler(seed=5).sample(logits, [p], [full[:5]]).token_ids.tolist()[0]
    assert resumed == full[5]
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 0)
    assert 0 <= step_seed(-3, 10**12) < 2**64


def test_sampled_tokens_stay_in_support() -> None:
    logits = _logits(64, seed=12)
    params = [SamplingParams(top_k=3, temperature=1.5) for _ in range(64)]
    out = Sampler(seed=3).sample(logits, params, [[] for _ in range(64)])
    top3 = torch.topk(logits, 3, dim=-1).indices
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(out.token_ids))


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = _logits(3, seed=13)
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, return_logprob=True, top_logprobs_num=4, seed=1),
        SamplingParams(temperature=0.0, return_logprob=True),
        SamplingParams(temperature=1.0, top_logprobs_num=3),  # did not ask: no logprobs
    ]
    res = Sampler(seed=0).sample(logits, params, [[1, 2], [], []], [[3], [4], [5]]).tolist()
    raw = logits.numpy().astype(np.float64)
    ref_lp = raw - raw.max(-1, keepdims=True)
    ref_lp = ref_lp - np.log(np.exp(ref_lp).sum(-1, keepdims=True))
    for b in range(2):
        assert res[b].logprob == pytest.approx(ref_lp[b][res[b].token_id], abs=1e-5)
    order = np.argsort(-ref_lp[0])[:4]
    assert [t for t, _ in res[0].top_logprobs] == order.tolist()
    assert [lp for _, lp in res[0].top_logprobs] == pytest.approx(ref_lp[0][order].tolist(), abs=1e-5)
    assert res[1].top_logprobs == []
    assert res[2].logprob is None and res[2].top_logprobs == []


def test_batch_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch of 2"):
        Sampler(seed=0).sample(_logits(2), [SamplingParams()], [[], []])


def test_logit_bias_matches_hf_sequence_bias_and_keeps_raw_logprobs() -> None:
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    logits = _logits(3)  # [3, V]
    biases = [{3: 100.0}, {int(torch.argmax(logits[1])): -100.0, 7: 5.5}, {}]
    params = [SamplingParams(temperature=0.0, logit_bias=b, return_logprob=True) for b in biases]
    out = Sampler(seed=0).sample(logits, params, [[], [], []])
    for i, b in enumerate(biases):
        proc = SequenceBiasLogitsProcessor({(t,): v for t, v in b.items()}) if b else None
        row = logits[i : i + 1].clone()  # [1, V]
        ref = proc(torch.zeros(1, 1, dtype=torch.int64), row) if proc else row  # [1, V]
        assert out.token_ids[i].item() == int(torch.argmax(ref[0]))
    assert out.token_ids[0].item() == 3
    raw = torch.log_softmax(logits, dim=-1)  # [3, V]
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))


def test_logit_bias_minus_100_excludes_token_from_sampling() -> None:
    logits = torch.zeros(1, V)  # [1, V] uniform
    banned = {t: -100.0 for t in range(V - 1)}
    p = SamplingParams(temperature=1.0, seed=5, logit_bias=banned)
    for step in range(20):
        tok = Sampler(seed=0).sample(logits, [p], [[0] * step]).token_ids.item()
        assert tok == V - 1


@pytest.mark.parametrize("bias,msg", [
    ({1: 101.0}, "in [-100, 100]"), ({-1: 1.0}, ">= 0"), ({V: 1.0}, "outside vocabulary"),
])
def test_logit_bias_validation(bias: dict[int, float], msg: str) -> None:
    from common.request import InvalidRequest

    with pytest.raises(InvalidRequest, match=msg.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias).validate(vocab_size=V)


def test_min_new_tokens_masks_eos_and_stop_ids_like_hf() -> None:
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    logits = _logits(1)  # [1, V]
    eos = int(torch.argmax(logits[0]))
    stop = int(torch.topk(logits[0], 2).indices[1])
    p = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[stop])
    sampler = Sampler(seed=0, eos_token_ids=[eos])
    proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=1, min_new_tokens=2, eos_token_id=[eos, stop])
    for step in range(4):
        ids = torch.zeros(1, 1 + step, dtype=torch.int64)  # [1, prompt + generated]
        ref = int(torch.argmax(proc(ids, logits.clone())[0]))
        assert sampler.sample(logits, [p], [[0] * step]).token_ids.item() == ref
    # Before min_new_tokens neither end id can come out; at it the argmax (eos) is allowed again.
    assert sampler.sample(logits, [p], [[0]]).token_ids.item() not in (eos, stop)
    assert sampler.sample(logits, [p], [[0, 0]]).token_ids.item() == eos


def test_min_new_tokens_above_max_is_rejected() -> None:
    from common.request import InvalidRequest

    with pytest.raises(InvalidRequest, match="min_new_tokens"):
        SamplingParams(max_new_tokens=3, min_new_tokens=4).validate()


def test_driver_fast_path_leaves_bias_and_min_tokens_to_the_sampler() -> None:
    """Greedy rows with logit_bias or min_new_tokens change the argmax: the driver's plain-greedy
    shortcut (argmax of the raw logits) must not take them, or the bias is silently ignored."""
    from types import SimpleNamespace

    from common.engine.driver import EngineDriver, SampleSpec
    from common.parallel import SINGLE_RANK

    driver = EngineDriver(SimpleNamespace(tp=SINGLE_RANK), Sampler(seed=0, eos_token_ids=[3]))  # type: ignore[arg-type]
    logits = torch.tensor([[0.0, 5.0, 1.0, 9.0]])  # raw argmax: 3 (the EOS)
    cases = [(SamplingParams(temperature=0.0), 3),
             (SamplingParams(temperature=0.0, logit_bias={2: 100.0}), 2),
             (SamplingParams(temperature=0.0, min_new_tokens=1), 1)]
    for params, want in cases:
        [tok] = driver._sample(logits, [SampleSpec(params, [])])
        assert tok is not None and tok.token_id == want, params
