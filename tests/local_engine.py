"""A single-process generate loop over the real engine parts (no disaggregation).

It is the engine's own end-to-end check: tests compare it with HF transformers, with no
scheduler or transfer in the way. Lifecycle of a request::

    pending --admit (row + prefix match + prompt pages)--> prefilling --last chunk--> decoding
        --stop rule--> finished (full pages into the prefix cache, rest freed)

Each step runs either one prefill batch (chunks of several requests up to ``max_prefill_tokens``,
each at most ``chunk_size``) or one decode step of every decoding request; prefill first, as
SGLang does, to keep the decode batch full.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.driver import EngineDriver, SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.req_kv import KVMemory, ReqKV
from common.request import FinishReason, SamplingParams
from common.sched.stop import StopChecker


@dataclass
class LocalResult:
    output_ids: list[int]
    finish: FinishReason | None
    cached_tokens: int
    tokens: list[SampledToken] = field(default_factory=list)


@dataclass
class _Req:
    idx: int
    prompt: list[int]
    params: SamplingParams
    kv: ReqKV | None = None
    out: list[int] = field(default_factory=list)
    sampled: list[SampledToken] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt + self.out


class LocalEngine:
    def __init__(self, driver: EngineDriver, memory: KVMemory, stop: StopChecker, chunk_size: int, max_prefill_tokens: int) -> None:
        self.driver = driver
        self.memory = memory
        self.stop = stop
        self.chunk_size = chunk_size if chunk_size > 0 else 1 << 30
        self.max_prefill_tokens = max_prefill_tokens

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[LocalResult]:
        reqs = [_Req(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        pending: deque[_Req] = deque(reqs)
        prefilling: list[_Req] = []
        decoding: list[_Req] = []
        while pending or prefilling or decoding:
            while pending and self._admit(pending[0]):
                prefilling.append(pending.popleft())
            if prefilling:
                self._prefill_step(prefilling, decoding)
            elif decoding:
                self._decode_step(decoding)
            else:
                raise RuntimeError("KV memory cannot hold even one request: raise max_total_tokens")
            for r in [r for r in decoding if r.finish is not None]:
                decoding.remove(r)
                self._finish(r)
        return [LocalResult(r.out, r.finish, r.kv.num_cached if r.kv else 0, r.sampled) for r in reqs]

    def _admit(self, r: _Req) -> bool:
        kv = self.memory.admit(r.prompt)
        if kv is None:
            return False
        if not self.memory.reserve(kv, len(r.prompt)):
            self.memory.release(kv, None)
            return False
        r.kv = kv
        return True

    def _prefill_step(self, prefilling: list[_Req], decoding: list[_Req]) -> None:
        budget = self.max_prefill_tokens
        chunks: list[ExtendChunk] = []
        specs: list[SampleSpec | None] = []
        batch: list[_Req] = []
        for r in prefilling:
            assert r.kv is not None
            n = min(len(r.prompt) - r.kv.kv_len, self.chunk_size, budget)
            if n <= 0:
                break
            chunks.append(ExtendChunk(r.kv.row, r.prompt[r.kv.kv_len : r.kv.kv_len + n], r.kv.kv_len))
            last = r.kv.kv_len + n == len(r.prompt)
            specs.append(SampleSpec(r.params, r.out, r.prompt) if last else None)
            batch.append(r)
            budget -= n
        results = self.driver.run_extend(chunks, specs)
        for r, c, tok in zip(batch, chunks, results):
            assert r.kv is not None
            r.kv.kv_len += len(c.input_ids)
            if tok is not None:
                prefilling.remove(r)
                decoding.append(r)
                self._append(r, tok)

    def _decode_step(self, decoding: list[_Req]) -> None:
        for r in decoding:
            assert r.kv is not None
            if not self.memory.reserve(r.kv, r.kv.kv_len + 1):
                raise RuntimeError("out of KV memory while decoding (the local engine does not retract)")
        items = [DecodeItem(r.kv.row, r.out[-1], r.kv.kv_len) for r in decoding if r.kv is not None]
        specs = [SampleSpec(r.params, r.out, r.prompt) for r in decoding]
        for r, tok in zip(decoding, self.driver.run_decode(items, specs)):
            assert r.kv is not None
            r.kv.kv_len += 1
            self._append(r, tok)

    def _append(self, r: _Req, tok: SampledToken) -> None:
        r.out.append(tok.token_id)
        r.sampled.append(tok)
        r.finish = self.stop.check(r.params, r.out)

    def _finish(self, r: _Req) -> None:
        assert r.kv is not None
        # The last sampled token has no KV yet: kv_len covers prompt + out[:-1].
        self.memory.release(r.kv, r.all_ids)
