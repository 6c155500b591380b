"""The engine step both node schedulers call: forward one batch, sample, return plain data.

Schedulers decide *what* runs (which chunks, which decodes) and own KV bookkeeping; the driver
only computes. Intermediate prompt chunks pass ``None`` as their sample spec: their logits
are not sampled (chunked prefill samples once, after the last chunk).

Contract: when ``run_extend``/``run_decode`` return, the batch's K/V is in the pool. Sampling
copies tokens to the host, which waits for the GPU anyway; a batch with nothing to sample (only
intermediate chunks) waits explicitly, because the prefill node hands those pages to the
transfer engine right away, and an RDMA read is not ordered after kernels on the compute stream.

Tensor parallelism: every rank computes the same logits and samples, then rank 0's token ids are
broadcast and replace the others' (``_agree``). Equal logits are not enough: an unseeded
sampled row draws from a generator seeded from the OS, different on every rank, and the ranks'
schedulers must append the same token to stay in step. Logprobs stay each rank's own (only rank
0 reports them). tp = 1 skips the broadcast.

Grammar masks overlap the forward: ``run_decode`` starts the constrained rows' bitmask on the
sampler's mask thread before the forward (llguidance computes it with the GIL released) and the
sampler waits for it after; the driver waits for it on every path before returning, because the
scheduler advances those matchers next.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.engine.model_runner import DecodeItem, ExtendChunk, ModelRunner
from common.engine.sampler import PendingMask, SampledToken, Sampler, needs_penalties
from common.grammar.backend import Matcher
from common.request import SamplingParams

if TYPE_CHECKING:
    from common.cpu_share import CoreBoard


@dataclass(frozen=True)
class SampleSpec:
    """How one request samples. ``output_ids`` is read at sampling time, so a request may keep one
    spec over its live output list for its whole life instead of building one per step."""

    params: SamplingParams
    output_ids: Sequence[int]  # generated so far (the step number for seeded sampling)
    prompt_ids: Sequence[int] | None = None  # needed only for repetition_penalty
    # The request's grammar matcher, advanced by output_ids (common/grammar/state.py); None: free.
    grammar: Matcher | None = None
    # Argmax and nothing else: no logprobs, penalties, bias, min_new_tokens or grammar (the common decode case,
    # sampled without the sampler's per-row bookkeeping).
    plain_greedy: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        # logit_bias and min_new_tokens change the argmax too: such rows go through the sampler.
        plain = (p.is_greedy and not p.return_logprob and not needs_penalties(p) and not p.logit_bias
                 and p.min_new_tokens == 0 and self.grammar is None)
        object.__setattr__(self, "plain_greedy", plain)


class EngineDriver:
    def __init__(self, runner: ModelRunner, sampler: Sampler, cores: CoreBoard | None = None) -> None:
        self.runner = runner
        self.sampler = sampler
        # Co-located nodes' core board (common/cpu_share.py): each forward claims its threads there,
        # and a decode sizes its pool to the cores idle neighbours lend. None: a fixed pool.
        self.cores = cores

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]:
        if len(chunks) != len(specs):
            raise ValueError(f"{len(chunks)} chunks but {len(specs)} sample specs")
        with self._claim():
            logits = self.runner.extend(chunks)  # [B, vocab]
            return self._sample(logits, specs)

    def run_decode(self, items: Sequence[DecodeItem], specs: Sequence[SampleSpec]) -> list[SampledToken]:
        if len(items) != len(specs):
            raise ValueError(f"{len(items)} decode items but {len(specs)} sample specs")
        # The constrained rows' masks are computed on the sampler's mask thread during the forward:
        # their matchers already hold every token emitted so far (common/grammar/state.py).
        mask = self.sampler.start_grammar_mask([s.grammar for s in specs]) if any(
            s.grammar is not None for s in specs) else None
        try:
            with self._claim():
                logits = self.runner.decode(items)  # [B, vocab]
                return [t for t in self._sample(logits, specs, mask) if t is not None]
        finally:
            if mask is not None:
                mask.settle()  # on every path: the scheduler advances these matchers next

    def _claim(self) -> AbstractContextManager:
        return nullcontext() if self.cores is None else self.cores.forward()

    def _sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec | None],
                grammar_mask: PendingMask | None = None) -> list[SampledToken | None]:
        if specs and all(s is not None and s.plain_greedy for s in specs):
            # What Sampler.sample computes for such rows (argmax of the raw logits), without its
            # per-row parameter lists.
            ids = self._agree(torch.argmax(logits, dim=-1))  # [B] int64
            return [SampledToken(t, None, []) for t in ids.tolist()]
        keep = [i for i, s in enumerate(specs) if s is not None]
        out: list[SampledToken | None] = [None] * len(specs)
        if not keep:
            if logits.is_cuda:
                torch.cuda.current_stream(logits.device).synchronize()
            return out
        chosen = [specs[i] for i in keep]  # type: ignore[misc]
        rows = logits if len(keep) == len(specs) else logits[torch.tensor(keep, device=logits.device)]  # [K, vocab]
        need_prompt = any(s.params.repetition_penalty != 1.0 for s in chosen)  # type: ignore[union-attr]
        sampled = self.sampler.sample(
            rows,
            [s.params for s in chosen],  # type: ignore[union-attr]
            [s.output_ids for s in chosen],  # type: ignore[union-attr]
            [s.prompt_ids or [] for s in chosen] if need_prompt else None,  # type: ignore[union-attr]
            [s.grammar for s in chosen] if any(s.grammar is not None for s in chosen) else None,  # type: ignore[union-attr]
            grammar_mask if len(keep) == len(specs) else None,  # started over all specs (run_decode)
        )
        sampled.token_ids = self._agree(sampled.token_ids)
        for i, tok in zip(keep, sampled.tolist()):
            out[i] = tok
        return out

    def _agree(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's token ids on every rank. [B] int64"""
        tp = self.runner.tp
        return token_ids if tp.size == 1 else tp.broadcast(token_ids.contiguous(), src=0)
