"""Batched next-token sampling over ``[B, V]`` float32 logits with per-request parameters.

Each row goes through the order Hugging Face ``generate`` uses (logits processors, then
warpers), so one request alone behaves like transformers with the same settings::

    raw logits ─► logprobs = log_softmax(raw logits)        (reported only; see below)
        │
        ├─ repetition penalty over prompt + output ids     HF: l/p if l > 0 else l*p
        ├─ frequency / presence penalty over output ids    OpenAI: l - f*count - p*[count > 0]
        ├─ logit bias                                      OpenAI: l + bias[token]
        ├─ min_new_tokens: EOS + stop_token_ids → -inf     HF MinNewTokensLengthLogitsProcessor
        ├─ grammar: tokens the row's matcher refuses → -inf  one bitmask for the batch (common/grammar)
        │
        ├─ greedy rows (temperature < 1e-5 or top_k 1) ─► argmax ────────────────────► token
        │
        └─ / temperature ─► top-k ─► top-p ─► min-p ─► exponential race (seeded) ─► token
                          (each filter sees the distribution renormalised after the previous one)

Logprobs are the *raw model* logprobs: log_softmax of the logits before penalties, temperature
and filters (what SGLang and vLLM return by default). They describe the model, not the sampler,
so they are comparable across requests with different sampling settings.

Randomness. A seeded request draws its noise from a generator seeded with
``mix(seed, len(output_ids))``: the token at step ``n`` depends only on (seed, n, the row's
logits). That makes seeded output independent of batch composition, and also of *where* the
token is sampled: the prefill node samples step 0 and the decode node step 1 on, a retracted and
recomputed request replays the same steps, and no generator state has to travel with the
request. Unseeded rows share the sampler's own generator.

Sampling is an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token picks
token ``i`` with probability ``p_i`` (the minimum of ``q_i / p_i`` is Exp-distributed with rate
``p_i``), needs no cumulative sum and is one vectorised op over the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from common.grammar.backend import GrammarBackend, Matcher, bitmask_width, refused_from_bitmask
from common.request import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of splitmix64: a bijective 64-bit mixer, so nearby inputs give unrelated outputs."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request's ``step``-th output token (0-based)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


@dataclass(frozen=True)
class SampledToken:
    """One request's result of one step, as plain Python data."""

    token_id: int
    logprob: float | None  # raw logprob of token_id; None when the request did not ask
    top_logprobs: list[tuple[int, float]]  # (token id, raw logprob), most likely first


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: torch.Tensor | None  # [B] float32 raw logprob of token_ids; None if no row asked
    top_ids: torch.Tensor | None  # [B, K] int64, K = max top_logprobs_num in the batch
    top_logprobs: torch.Tensor | None  # [B, K] float32
    want_logprob: list[bool]  # per row: SamplingParams.return_logprob
    top_nums: list[int]  # per row: how many of the K top entries belong to it

    def tolist(self) -> list[SampledToken]:
        """Copy to the host once and split per request."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        tids = self.top_ids.tolist() if self.top_ids is not None else None
        tlps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out: list[SampledToken] = []
        for i, tok in enumerate(ids):
            lp = lps[i] if lps is not None and self.want_logprob[i] else None
            n = self.top_nums[i] if tids is not None and tlps is not None else 0
            top = list(zip(tids[i][:n], tlps[i][:n])) if n else []
            out.append(SampledToken(token_id=tok, logprob=lp, top_logprobs=top))
        return out


def needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row. [B, V] float32.

    Rows are padded with the id ``vocab``, which lands in a spill column that is cut off.
    """
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.int64)  # [B, L]
    for i, r in enumerate(rows):
        if r:
            padded[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)  # [B, V+1]
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """Return penalised logits (a new tensor); rows without penalties are unchanged.

    logits: [B, V] float32. Repetition penalty (HF) covers prompt and output ids; frequency and
    presence penalties (OpenAI) cover output ids only.
    """
    out = logits.clone()  # [B, V]
    bsz, vocab = out.shape
    device = out.device
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        if prompt_ids is None:
            raise ValueError("repetition_penalty needs prompt_ids")
        seen_rows = [list(prompt_ids[i]) + list(output_ids[i]) if rep[i] != 1.0 else [] for i in range(bsz)]
        seen = _token_counts(seen_rows, vocab, device) > 0  # [B, V] bool
        pen = torch.tensor(rep, dtype=torch.float32, device=device)[:, None]  # [B, 1]
        penalised = torch.where(out > 0, out / pen, out * pen)  # [B, V]
        out = torch.where(seen, penalised, out)
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres):
        counts = _token_counts(output_ids, vocab, device)  # [B, V]
        f = torch.tensor(freq, dtype=torch.float32, device=device)[:, None]  # [B, 1]
        pr = torch.tensor(pres, dtype=torch.float32, device=device)[:, None]  # [B, 1]
        out = out - f * counts - pr * (counts > 0).to(torch.float32)
    return out


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Return logits plus each row's OpenAI ``logit_bias`` (a new tensor). logits: [B, V] float32."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for t, b in p.logit_bias.items():
            rows.append(i)
            cols.append(t)
            vals.append(b)
    device = logits.device
    bias = torch.zeros_like(logits)  # [B, V]
    r = torch.tensor(rows, dtype=torch.int64, device=device)  # [N] one entry per (row, token)
    c = torch.tensor(cols, dtype=torch.int64, device=device)  # [N]
    bias[r, c] = torch.tensor(vals, dtype=torch.float32, device=device)  # [N]
    return logits + bias


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The distribution a non-greedy row samples from. [B, V] float32, rows sum to 1.

    logits [B, V] float32 (penalised); temperature [B] float32 > 0; top_k [B] int64 in [1, V]
    (V = off); top_p [B] float32 in (0, 1] (1 = off); min_p [B] float32 in [0, 1] (0 = off).
    Top-k keeps ties at the k-th value, as HF's TopKLogitsWarper does.
    """
    scaled = logits / temperature[:, None]  # [B, V]
    vocab = scaled.shape[1]
    # Work in descending order: position 0 is the most likely token of each row.
    #   sorted[b, j] = scaled[b, order[b, j]]
    srt, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [B, V], [B, V] int64
    kth = srt.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])  # [B, 1]
    srt = srt.masked_fill(srt < kth, float("-inf"))
    probs = torch.softmax(srt, dim=-1)  # [B, V] renormalised over the top-k
    # Top-p: keep a token while the mass strictly before it is below top_p; the first token
    # always survives (mass before it is 0). Rows at top_p == 1 skip this: cumsum rounding can
    # reach 1.0 early and would cut the tail.
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, V]
    tp = top_p[:, None]  # [B, 1]
    probs = probs.masked_fill((mass_before >= tp) & (tp < 1.0), 0.0)
    # Min-p: relative to the most likely token, so renormalising first would not change it.
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)  # back to vocabulary order


@dataclass
class PendingMask:
    """The allowed-token bitmask of a batch's constrained rows, being filled on the sampler's mask
    thread (``Sampler.start_grammar_mask``) while the forward runs."""

    rows: list[int]  # batch rows that carry a matcher, in bitmask order
    bitmask: torch.Tensor  # int32 [G, ceil(V/32)]
    future: Future[None]

    def result(self) -> torch.Tensor:
        self.future.result()  # re-raises what the backend raised
        return self.bitmask

    def settle(self) -> None:
        """Wait without raising: the matchers must not move while the backend still reads them."""
        wait([self.future])


class Sampler:
    """Stateless apart from the generator unseeded rows draw from.

    ``seed`` fixes that generator (tests, benchmarks); None seeds it from the OS.
    ``eos_token_ids`` are the model's end ids, masked (with each row's stop_token_ids) for rows
    that have not reached their ``min_new_tokens`` yet. ``grammar`` computes the allowed-token
    bitmask of the rows that carry a matcher (None: no row may).
    """

    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = (),
                 grammar: GrammarBackend | None = None) -> None:
        self._seed = seed
        self._eos = tuple(eos_token_ids)
        self._grammar = grammar
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}
        self._mask_pool: ThreadPoolExecutor | None = None  # started with the first overlapped mask

    def _shared_gen(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen

    def _seeded_gen(self, device: torch.device, seed: int) -> torch.Generator:
        # One generator per device, re-seeded per row: manual_seed is cheap, construction less so.
        gen = self._seeded.get(device)
        if gen is None:
            gen = self._seeded[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def start_grammar_mask(self, grammars: Sequence[Matcher | None]) -> PendingMask | None:
        """Start filling the bitmask of the rows that carry a matcher on a worker thread and return
        at once, so the masks are computed while the forward runs (the backend releases the GIL;
        a decode step's matchers are final before its forward). ``sample(..., grammar_mask=)``
        waits for it. The caller must not advance these matchers before it has waited (``settle``
        on every path). None when no row carries a matcher."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        if self._grammar is None:
            raise RuntimeError("a request carries a grammar but this sampler has no grammar backend")
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        bitmask = torch.zeros(len(rows), bitmask_width(self._grammar.vocab_size), dtype=torch.int32)  # [G, W]
        pairs = [(grammars[i], j) for j, i in enumerate(rows)]
        return PendingMask(rows, bitmask, self._mask_pool.submit(self._grammar.fill_bitmask, pairs, bitmask))  # type: ignore[arg-type]

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        grammars: Sequence[Matcher | None] | None = None,
        grammar_mask: PendingMask | None = None,
    ) -> SampleOutput:
        """Pick one token per row.

        logits: [B, V] float32, row i belongs to params[i]. ``output_ids[i]`` are the tokens the
        request generated so far (its length is the step number seeds are mixed with, and the
        frequency/presence penalties count them). ``prompt_ids`` is needed only when some row
        has a repetition penalty. ``grammars[i]``, when not None, is row i's matcher, already
        advanced by ``output_ids[i]``: only tokens it allows can be picked. ``grammar_mask``: their
        bitmask, already started (``start_grammar_mask`` over the same ``grammars``).
        """
        bsz, vocab = logits.shape
        if len(params) != bsz or len(output_ids) != bsz:
            raise ValueError(f"batch of {bsz} logits rows, {len(params)} params, {len(output_ids)} output_ids")
        logits = logits.float()  # [B, V] (no-op for float32)
        top_nums = [p.top_logprobs_num for p in params]
        want_lp = [p.return_logprob for p in params]
        # Raw logprobs, before anything below changes the logits.
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None  # [B, V]

        penalised = any(needs_penalties(p) for p in params)
        greedy = [p.is_greedy for p in params]
        if penalised:
            logits = apply_penalties(logits, params, output_ids, prompt_ids)  # [B, V]
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)  # [B, V]
        if any(len(o) < p.min_new_tokens for p, o in zip(params, output_ids)):
            logits = self._mask_ends(logits, params, output_ids)  # [B, V]
        if grammars is not None and any(g is not None for g in grammars):
            logits = self._mask_grammar(logits, grammars, grammar_mask)  # [B, V]
        if all(greedy):
            token_ids = torch.argmax(logits, dim=-1)  # [B] int64; fast path, nothing else runs
        else:
            token_ids = self._sample_mixed(logits, params, output_ids, greedy)

        chosen = top_ids = top_vals = None
        if raw_lp is not None:
            chosen = raw_lp.gather(1, token_ids[:, None]).squeeze(1)  # [B]
            k = min(max(top_nums), vocab)
            if k > 0:
                top_vals, top_ids = torch.topk(raw_lp, k, dim=-1)  # [B, K], [B, K]
        return SampleOutput(
            token_ids=token_ids,
            logprobs=chosen,
            top_ids=top_ids,
            top_logprobs=top_vals,
            want_logprob=want_lp,
            top_nums=[n if w else 0 for n, w in zip(top_nums, want_lp)],
        )

    def _mask_ends(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """-inf at the end ids of rows still short of min_new_tokens. logits: [B, V] float32."""
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, o) in enumerate(zip(params, output_ids)):
            if len(o) < p.min_new_tokens:
                for t in set(self._eos) | set(p.stop_token_ids):
                    rows.append(i)
                    cols.append(t)
        if not rows:
            return logits
        device = logits.device
        out = logits.clone()  # [B, V]
        r = torch.tensor(rows, dtype=torch.int64, device=device)  # [N]
        c = torch.tensor(cols, dtype=torch.int64, device=device)  # [N]
        out[r, c] = float("-inf")
        return out

    def _mask_grammar(self, logits: torch.Tensor, grammars: Sequence[Matcher | None],
                      pending: PendingMask | None = None) -> torch.Tensor:
        """-inf at every token a row's matcher refuses; rows without one are unchanged.

        One bitmask for all constrained rows, filled by the backend in one call (its threads work
        on the rows in parallel; on a decode step started before the forward, ``pending``),
        unpacked and applied as one ``torch.where``. A row whose mask
        allows nothing keeps only -inf: its argmax is a token the matcher then refuses, which the
        scheduler reports as a dead end. logits: [B, V] float32.
        """
        if self._grammar is None:
            raise RuntimeError("a request carries a grammar but this sampler has no grammar backend")
        vocab = logits.shape[1]
        if vocab != self._grammar.vocab_size:
            raise RuntimeError(f"logits have {vocab} columns; the grammar backend was built for {self._grammar.vocab_size}")
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if pending is not None:
            assert pending.rows == rows, "the started mask is for other rows"
            bitmask = pending.result()  # [G, W]
        else:
            bitmask = torch.zeros(len(rows), bitmask_width(vocab), dtype=torch.int32)  # [G, W]
            self._grammar.fill_bitmask([(grammars[i], j) for j, i in enumerate(rows)], bitmask)  # type: ignore[misc]
        refused = refused_from_bitmask(bitmask.to(logits.device), vocab)  # [G, V] bool
        # torch.where with a scalar is a third of masked_fill's time on the host (measured at
        # [32, 1000]); both give a new tensor, the caller's logits stay as they were.
        if len(rows) == logits.shape[0]:  # every row constrained: one op, no gather or scatter
            return torch.where(refused, float("-inf"), logits)  # [B, V]
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [G]
        out = logits.clone()  # [B, V]
        out[idx] = torch.where(refused, float("-inf"), out[idx])
        return out

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        greedy: list[bool],
    ) -> torch.Tensor:
        """Greedy rows take the argmax; the others sample. Returns [B] int64."""
        device = logits.device
        vocab = logits.shape[1]
        token_ids = torch.argmax(logits, dim=-1)  # [B] int64 (greedy rows keep this)
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = [params[i] for i in rows]
        idx = torch.tensor(rows, dtype=torch.int64, device=device)  # [S]

        def col(vals: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(vals, dtype=dtype, device=device)  # [S]

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in sub]
        # Sampled rows are not greedy, so each temperature is >= GREEDY_TEMPERATURE (> 0 in float32).
        temperature = col([p.temperature for p in sub], torch.float32)  # [S]
        sub_logits = logits.index_select(0, idx)  # [S, V]
        # Decided on the host so the plain-temperature batch costs no sort and no device sync.
        if any(k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for k, p in zip(top_k, sub)):
            probs = filter_probs(
                sub_logits,
                temperature=temperature,
                top_k=col(top_k, torch.int64),
                top_p=col([p.top_p for p in sub], torch.float32),
                min_p=col([p.min_p for p in sub], torch.float32),
            )  # [S, V]
        else:
            probs = torch.softmax(sub_logits / temperature[:, None], dim=-1)  # [S, V]

        noise = torch.empty_like(probs)  # [S, V] Exp(1) draws
        if any(p.seed is None for p in sub):
            noise.exponential_(generator=self._shared_gen(device))
        for j, (i, p) in enumerate(zip(rows, sub)):
            if p.seed is not None:
                gen = self._seeded_gen(device, step_seed(p.seed, len(output_ids[i])))
                noise[j].exponential_(generator=gen)
        # Exp(1) can round to 0; a tiny floor keeps the ratio finite (the chance is ~2^-24).
        picked = torch.argmax(probs / noise.clamp_min(1e-10), dim=-1)  # [S] int64
        return token_ids.index_copy(0, idx, picked)
