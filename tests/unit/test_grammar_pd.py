"""Grammar state across prefill and decode, on the schedulers' test rigs (fake transfer, real
llguidance and the real sampler over pseudo-random logits):

- the decode's matcher is advanced by the prefill's first token before its first step, for a
  schema whose first token is forced ('{') and for one where it is free (any of several): a
  decode that started a fresh matcher (SGLang issue 21945) would emit '{{' or a second value;
- retraction and recompute keep outputs valid and exactly equal to a run without retraction;
- the prefill runs its batch while a grammar compiles, samples the first token under it once
  ready, and fails only the request whose compile outlived the timeout.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
import torch

from common.engine.driver import SampleSpec
from common.engine.sampler import SampledToken, Sampler
from common.grammar.cache import GrammarCache
from common.grammar.factory import load_backend
from common.grammar.spec import GrammarSpec
from common.grammar.state import GrammarState
from common.request import SamplingParams
from common.sched.stop import StopChecker
from common.tokenizer import Tokenizer
from tests.unit.test_decode_scheduler import PS, FakeEngine, Rig, next_token
from tests.unit.test_prefill_scheduler import Node, gen, prompt
from transfer.aux import AuxRecord
from transfer.poll import KVPoll

OBJ = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
       "required": ["id", "tags"], "additionalProperties": False}
FREE = {"enum": ["alpha", 7, True]}  # the first token may be '"', '7' or 't'


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def backend(tok: Tokenizer) -> Any:
    return load_backend("llguidance", tok.backend_json(), tok.vocab_size, sorted(tok.eos_token_ids), threads=1)


def logits_for(seq: Sequence[int], vocab: int) -> torch.Tensor:
    """Pseudo-random logits that depend on the whole sequence, like a random-weight model's."""
    g = torch.Generator().manual_seed(next_token(seq))
    return torch.randn(1, vocab, generator=g) * 8  # [1, V]


class GrammarEngine(FakeEngine):
    """The decode rig's engine, sampling through the real sampler (grammar mask included)."""

    def __init__(self, memory: Any, sampler: Sampler, vocab: int) -> None:
        super().__init__(memory)
        self.sampler, self.vocab = sampler, vocab

    def _sample(self, seq: list[int], spec: SampleSpec) -> SampledToken:
        assert seq == list(spec.prompt_ids or []) + list(spec.output_ids), "KV does not match prompt + output"
        out = self.sampler.sample(logits_for(seq, self.vocab), [spec.params], [spec.output_ids], grammars=[spec.grammar])
        return SampledToken(int(out.token_ids[0]), None, [])


def grammar_rig(tok: Tokenizer, backend: Any, **kw: Any) -> tuple[Rig, GrammarCache]:
    rig = Rig(stop=StopChecker(tok.eos_token_ids), **kw)
    cache = GrammarCache(backend, threads=1)
    rig.engine = GrammarEngine(rig.memory, Sampler(grammar=backend), tok.vocab_size)
    rig.hub.engine = rig.engine
    rig.sched.engine, rig.sched.grammars = rig.engine, cache
    return rig, cache


def prefill_first_token(backend: Any, spec: GrammarSpec, prompt_ids: list[int], vocab: int) -> int:
    """What the prefill samples as token 0: a fresh matcher's mask over the prompt's logits."""
    m = backend.matcher(backend.compile(spec))
    out = Sampler(grammar=backend).sample(logits_for(prompt_ids, vocab), [SamplingParams(temperature=0.0)], [[]],
                                          grammars=[m])
    return int(out.token_ids[0])


def hand_first_tokens(rig: Rig, first: dict[int, int]) -> None:
    """The rig's prefill half writes ``first[room]`` as the aux row's token instead of its own."""
    hub = rig.hub

    def complete(room: int, logprob: float = -0.5) -> None:
        r = hub.rx[room]
        assert r.status is KVPoll.Transferring and r.pages is not None and r.slot is not None
        for i, t in enumerate(hub.prompts[room]):
            hub.engine.kv[r.pages[i // PS] * PS + i % PS] = t
        hub.aux.write(r.slot, AuxRecord(room=room, token_id=first[room], cached_tokens=0, logprob=logprob,
                                        top_ids=(), top_logprobs=()))
        r.status = KVPoll.Success

    hub.complete = complete  # type: ignore[method-assign]


def prompt_of_tokens(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def run_until_idle(rig: Rig) -> None:
    for _ in range(3000):
        if rig.sched.idle() and not rig.inbox:
            return
        rig.step()
        if rig.sched.queues.waiting:  # a compile may still be running on the pool
            threading.Event().wait(0.001)
    raise AssertionError("scheduler did not go idle")


@pytest.mark.parametrize("schema,first_text", [(OBJ, None), (FREE, '"'), (FREE, "7"), (FREE, "t")])
def test_decode_advances_its_matcher_by_the_prefills_first_token(tok: Tokenizer, backend: Any, schema: dict,
                                                                 first_text: str | None) -> None:
    rig, cache = grammar_rig(tok, backend)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    p = prompt_of_tokens(tok, "give me json")
    if first_text is None:  # forced: the prefill can only have sampled '{'
        first = prefill_first_token(backend, spec, p, tok.vocab_size)
        assert tok.decode([first]) == "{"
    else:  # free: each allowed first token in turn (as a sampled prefill may pick any)
        [first] = tok.encode(first_text, add_special_tokens=False)
    hand_first_tokens(rig, {1: first})
    rig.add("a", p, 60, room=1, json_schema=spec.text)
    run_until_idle(rig)
    fin = rig.final("a")
    ids = rig.tokens("a")
    assert fin.error is None and fin.finish is not None and fin.finish.type == "stop", (fin, tok.decode(ids))
    assert ids[0] == first
    jsonschema.validate(json.loads(tok.decode(ids)), schema)
    rig.assert_clean()
    cache.close()


def test_retraction_keeps_constrained_outputs_valid_and_exact(tok: Tokenizer, backend: Any) -> None:
    """The same requests on a pool that forces retractions and on one that does not: equal outputs."""
    spec = GrammarSpec("json_schema", json.dumps(OBJ))

    def run(pages: int) -> tuple[dict[str, list[int]], int]:
        rig, cache = grammar_rig(tok, backend, pages=pages, reserved=1, ratio_init=0.05)
        first = {}
        for i in range(6):
            p = prompt_of_tokens(tok, f"record number {i} please")
            first[i + 1] = prefill_first_token(backend, spec, p, tok.vocab_size)
            rig.add(f"r{i}", p, 40, room=i + 1, json_schema=spec.text)
        hand_first_tokens(rig, first)
        run_until_idle(rig)
        rig.assert_clean()
        cache.close()
        return {f"r{i}": rig.tokens(f"r{i}") for i in range(6)}, rig.sched.counters.retractions

    roomy, none = run(64)
    tight, retractions = run(20)  # admission is optimistic: growing outputs retract some
    assert none == 0 and retractions > 0
    assert tight == roomy
    for ids in tight.values():
        jsonschema.validate(json.loads(tok.decode(ids)), OBJ)


def test_a_local_request_samples_its_first_token_under_the_grammar(tok: Tokenizer, backend: Any) -> None:
    rig, cache = grammar_rig(tok, backend)
    rig.add("loc", prompt_of_tokens(tok, "local"), 30, regex="(yes|no)[0-9]{2}")
    run_until_idle(rig)
    fin = rig.final("loc")
    text = tok.decode(rig.tokens("loc"))
    assert fin.finish is not None and fin.finish.type == "stop" and text[:-2] in ("yes", "no") and text[-2:].isdigit()
    cache.close()


# ---- prefill -------------------------------------------------------------------------------------


class GatedBackend:
    """Compiles ``slow`` specs only once ``gate`` opens (a stand-in for a costly schema)."""

    name, vocab_size = "gated", 64

    def __init__(self) -> None:
        self.gate = threading.Event()

    def check(self, spec: GrammarSpec) -> str | None:
        return None

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.text == "slow":
            self.gate.wait(30)
        return spec.text

    def matcher(self, compiled: Any) -> Any:
        return ("matcher", compiled)

    def fill_bitmask(self, rows: Any, bitmask: torch.Tensor) -> None:
        raise AssertionError("the stub engine does not sample")


def wait_compiled(state: GrammarState) -> None:
    for _ in range(2000):
        if state.handle._future is None or state.handle._future.done():
            return
        threading.Event().wait(0.002)
    raise AssertionError("compile did not finish")


def test_prefill_runs_the_batch_while_a_grammar_compiles_then_samples_under_it() -> None:
    be = GatedBackend()
    node = Node()
    cache = GrammarCache(be, threads=1, timeout_s=5.0, clock=lambda: node.now)
    node.sched.grammars = cache
    specs: list[SampleSpec | None] = []
    run = node.engine.run_extend
    node.engine.run_extend = lambda chunks, ss: (specs.extend(ss), run(chunks, ss))[1]  # type: ignore[method-assign]
    try:
        node.step(gen("g", prompt(8), room=1, regex="slow"), gen("plain", prompt(8, base=50), room=2))
        node.ready(1, 2)
        node.step()
        assert node.sender(2).sent and not node.sender(1).sent  # the batch ran without the pending one
        be.gate.set()
        wait_compiled(node.sched.queues.reqs["g"].grammar)  # type: ignore[arg-type]
        node.step()
        assert node.sender(1).sent and node.sender(1).sent[-1][2] is not None  # first token in the aux row
        assert [s.grammar for s in specs if s is not None] == [None, ("matcher", "slow")]
        for room in (1, 2):
            node.sender(room).state = KVPoll.Success
        node.step()
        assert node.replies["g"].http_status is None and node.replies["plain"].http_status is None
        node.assert_idle()
    finally:
        be.gate.set()
        cache.close()


def test_prefill_compile_timeout_fails_that_request_alone() -> None:
    be = GatedBackend()
    node = Node()
    cache = GrammarCache(be, threads=1, timeout_s=2.0, clock=lambda: node.now)
    node.sched.grammars = cache
    try:
        node.step(gen("g", prompt(8), room=1, regex="slow"), gen("plain", prompt(8, base=50), room=2))
        node.ready(1, 2)
        node.step()
        node.now += 2.5  # past the compile timeout
        node.step()
        node.step()  # the aborted room reports Failed; the reply goes out
        g = node.replies["g"]
        assert g.http_status == 400 and "did not compile within" in (g.error or ""), g
        assert "plain" not in node.replies and node.sender(2).sent  # the other request went on
        node.sender(2).state = KVPoll.Success
        node.step()
        assert node.replies["plain"].http_status is None
        node.assert_idle()
    finally:
        be.gate.set()
        cache.close()
