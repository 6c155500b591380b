"""Constrained decoding's parts, one at a time: parse-time checks (the 400s), the compile cache
(bounds, sharing, timeout), the batched bitmask in the sampler (greedy and sampled rows), and
the llguidance backend against llguidance's own matcher used directly."""
from __future__ import annotations

import json
import threading
from typing import Any

import llguidance as llg
import pytest
import torch

from common.engine.sampler import Sampler
from common.grammar.backend import GrammarError, allowed_from_bitmask, refused_from_bitmask
from common.grammar.cache import GrammarCache
from common.grammar.factory import load_backend
from common.grammar.spec import JSON_OBJECT_SCHEMA, GrammarSpec, spec_of
from common.grammar.state import GrammarState
from common.request import SamplingParams
from common.server.config import ApiConfig
from common.server.errors import ApiError
from common.server.parse_native import parse_generate
from common.server.parse_openai import parse_chat, parse_completion
from common.tokenizer import Tokenizer

OBJ = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def cfg(tiny_qwen3: str) -> ApiConfig:
    return ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=256)


@pytest.fixture(scope="module")
def backend(tok: Tokenizer) -> Any:
    return load_backend("llguidance", tok.backend_json(), tok.vocab_size, sorted(tok.eos_token_ids), threads=1)


# ---- the API surface -----------------------------------------------------------------------------


def test_response_format_and_extras_become_grammar_fields(cfg: ApiConfig, tok: Tokenizer) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat({**chat, "response_format": {"type": "json_object"}}, cfg, tok)
    assert spec_of(req.subs[0].sampling) == GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJ, "strict": True}}
    req = parse_chat({**chat, "response_format": fmt, "n": 2}, cfg, tok)
    assert all(json.loads(s.sampling.json_schema or "") == OBJ for s in req.subs)
    assert spec_of(parse_chat({**chat, "response_format": {"type": "text"}}, cfg, tok).subs[0].sampling) is None
    req = parse_completion({"prompt": "a", "regex": "[ab]{3}"}, cfg, tok)
    assert spec_of(req.subs[0].sampling) == GrammarSpec("regex", "[ab]{3}")
    # /generate: SGLang sends the schema as JSON text; an object is taken too.
    for schema in (json.dumps(OBJ), OBJ):
        req = parse_generate({"text": "a", "sampling_params": {"json_schema": schema}}, cfg, tok)
        assert json.loads(req.subs[0].sampling.json_schema or "") == OBJ
    req = parse_generate({"text": "a", "sampling_params": {"ebnf": 'root ::= "yes" | "no"'}}, cfg, tok)
    assert spec_of(req.subs[0].sampling) == GrammarSpec("ebnf", 'root ::= "yes" | "no"')


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parse,body,needles", [
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     ["invalid json_schema", "foo"]),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}, "then": {}}}}},
     ["Unimplemented keys", "if"]),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     ["json_schema.schema", "JSON object"]),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema"}}, ["response_format.json_schema"]),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": OBJ, "strict": "yes"}}},
     ["strict"]),
    (parse_chat, {**CHAT, "response_format": "json"}, ["response_format", "object"]),
    (parse_chat, {**CHAT, "response_format": {"type": "json_object"}, "regex": "a"}, ["not both"]),
    (parse_completion, {"prompt": "a", "regex": "(ab"}, ["invalid regex", "unclosed group"]),
    (parse_completion, {"prompt": "a", "regex": "a", "ebnf": "root ::= \"a\""}, ["at most one", "regex and ebnf"]),
    (parse_generate, {"text": "a", "sampling_params": {"json_schema": "{not json"}}, ["json_schema", "not valid JSON"]),
    (parse_generate, {"text": "a", "sampling_params": {"json_schema": {"type": "string", "format": "nope"}}},
     ["Unknown format", "nope"]),
    (parse_generate, {"text": "a", "sampling_params": {"ebnf": "root ::= ("}}, ["invalid ebnf"]),
    (parse_generate, {"text": "a", "sampling_params": {"regex": ""}}, ["regex must not be empty"]),
])
def test_bad_grammar_is_a_400_naming_the_reason(cfg: ApiConfig, tok: Tokenizer, parse: Any, body: dict,
                                                needles: list[str]) -> None:
    with pytest.raises(ApiError) as ei:
        parse(body, cfg, tok)
    assert ei.value.status == 400
    for n in needles:
        assert n in ei.value.message, ei.value.message


def test_backend_none_refuses_grammars_at_parse_time(tiny_qwen3: str, tok: Tokenizer) -> None:
    off = ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=256, grammar_backend="none")
    with pytest.raises(ApiError, match="turned off"):
        parse_completion({"prompt": "a", "response_format": {"type": "json_object"}}, off, tok)
    parse_completion({"prompt": "a"}, off, tok)  # everything else still works


# ---- the compile cache ---------------------------------------------------------------------------


class CountingBackend:
    """Compiles instantly (or when ``gate`` opens) and counts compiles; matchers are never used."""

    name, vocab_size = "fake", 8

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.compiled: list[str] = []
        self.gate = gate

    def check(self, spec: GrammarSpec) -> str | None:
        return None

    def compile(self, spec: GrammarSpec) -> Any:
        if self.gate is not None:
            assert self.gate.wait(10)
        if spec.text == "bad":
            raise GrammarError("invalid regex: bad")
        self.compiled.append(spec.text)
        return ("compiled", spec.text)

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def fill_bitmask(self, rows: Any, bitmask: torch.Tensor) -> None:
        raise AssertionError("not sampled here")


def _wait_ready(cache: GrammarCache, spec: GrammarSpec) -> None:
    h = cache.get(spec)
    for _ in range(1000):
        if h.poll(0.0) != "pending":
            break
        threading.Event().wait(0.005)
    assert h.poll(0.0) == "ready", h.error


def test_cache_compiles_once_per_spec_and_stays_bounded() -> None:
    be = CountingBackend()
    cache = GrammarCache(be, capacity=2, threads=1)
    try:
        for text in ("a", "b", "a", "c", "a", "b"):
            _wait_ready(cache, GrammarSpec("regex", text))
        # a, b compiled; a hit; c evicts b (a was used more recently); a hit; b again evicts c.
        assert be.compiled == ["a", "b", "c", "b"]
        assert len(cache) == 2 and cache.stats.evictions == 2 and cache.stats.hits == 2
        m = cache.metrics()  # what /metrics exports as pdc_scheduler_grammar_*
        assert (m["grammar_cache_entries"], m["grammar_cache_misses_total"], m["grammar_cache_evictions_total"]) == (2, 4, 2)
    finally:
        cache.close()


def test_requests_share_an_inflight_compile_and_the_listener_wakes_the_loop() -> None:
    gate = threading.Event()
    be = CountingBackend(gate)
    woken = threading.Event()
    cache = GrammarCache(be, capacity=4, threads=2)
    cache.set_listener(woken.set)
    try:
        h1, h2 = cache.get(GrammarSpec("regex", "x"), 0.0), cache.get(GrammarSpec("regex", "x"), 0.0)
        assert h1.poll(0.0) == h2.poll(0.0) == "pending"
        gate.set()
        assert woken.wait(5)
        _wait_ready(cache, GrammarSpec("regex", "x"))
        assert h1.poll(0.0) == h2.poll(0.0) == "ready" and be.compiled == ["x"]
    finally:
        cache.close()


def test_compile_timeout_fails_the_waiting_request_and_errors_are_not_cached() -> None:
    gate = threading.Event()
    cache = GrammarCache(CountingBackend(gate), capacity=4, threads=1, timeout_s=2.0)
    try:
        slow = GrammarState.start(cache, GrammarSpec("regex", "slow"), now=100.0)
        assert slow.poll(101.9) == "pending"
        assert slow.poll(102.1) == "failed" and "did not compile within" in (slow.error or "")
        gate.set()
        bad = GrammarState.start(cache, GrammarSpec("regex", "bad"), now=0.0)
        for _ in range(1000):
            if bad.poll(0.0) != "pending":
                break
            threading.Event().wait(0.005)
        assert bad.poll(0.0) == "failed" and bad.error == "invalid regex: bad"
        assert len(cache) == 1 and cache.stats.compile_failures == 1  # "slow" finished and was kept
    finally:
        cache.close()


# ---- the sampler's bitmask, against llguidance used directly ------------------------------------


def _reference_allowed(tok: Tokenizer, spec_grammar: str, prefix: list[int]) -> torch.Tensor:
    """Allowed next tokens by llguidance's own matcher and its own bitmask (not our unpacking)."""
    lt = llg.LLTokenizer(tok.backend_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))
    m = llg.LLMatcher(lt, spec_grammar, log_level=0)
    assert m.consume_tokens(prefix)
    raw = m.compute_bitmask()  # one bit per token, little-endian within each 32-bit word
    bits = [(raw[t // 8] >> (t % 8)) & 1 for t in range(tok.vocab_size)]
    return torch.tensor(bits, dtype=torch.bool)


def test_bitmask_unpacking_matches_llguidance(tok: Tokenizer, backend: Any) -> None:
    grammar = llg.LLMatcher.grammar_from_regex("(cache|node)[0-9]{1,3}")
    prefix = tok.encode("ca", add_special_tokens=False)
    ref = _reference_allowed(tok, grammar, prefix)
    st = _ready_state(backend, GrammarSpec("regex", "(cache|node)[0-9]{1,3}"))
    assert st.sync(prefix)
    mask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    backend.fill_bitmask([(st.matcher, 0)], mask)
    got = allowed_from_bitmask(mask, tok.vocab_size)[0]
    assert torch.equal(got, ref) and 0 < int(ref.sum()) < tok.vocab_size


@pytest.mark.parametrize("vocab", [1, 8, 31, 32, 33, 1000, 1141])
def test_the_host_unpack_refuses_exactly_the_tokens_not_allowed(vocab: int) -> None:
    """The sampler's numpy unpack (one pass over the bytes) against the bit arithmetic of
    ``allowed_from_bitmask``: random words, the sign bit included, any vocabulary width."""
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-(2**31), 2**31, (5, (vocab + 31) // 32), dtype=torch.int64, generator=gen).to(torch.int32)
    refused = refused_from_bitmask(words, vocab)
    assert refused.shape == (5, vocab) and refused.dtype == torch.bool
    assert torch.equal(refused, ~allowed_from_bitmask(words, vocab))
    one = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    one[0, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32) if (vocab - 1) % 32 < 31 else -(2**31)
    assert refused_from_bitmask(one, vocab)[0].logical_not().nonzero().flatten().tolist() == [vocab - 1]


def _ready_state(backend: Any, spec: GrammarSpec) -> GrammarState:
    st = GrammarState.start(GrammarCache(backend, threads=1), spec, 0.0)
    for _ in range(1000):
        if st.poll(0.0) != "pending":
            break
        threading.Event().wait(0.005)
    assert st.poll(0.0) == "ready", st.error
    return st


@pytest.mark.parametrize("started", [False, True], ids=["in-sample", "started-before"])
def test_sampler_masks_greedy_and_sampled_rows_in_one_batch(tok: Tokenizer, backend: Any, started: bool) -> None:
    """Row 0 greedy under a regex, row 1 sampled under a schema, row 2 free: constrained rows
    only ever pick allowed tokens, a greedy row picks the best allowed one, the free row is untouched.
    ``started-before``: the mask is started on the mask thread first, as run_decode does before
    its forward."""
    torch.manual_seed(0)
    regex = _ready_state(backend, GrammarSpec("regex", "[0-9]{4}"))
    schema = _ready_state(backend, GrammarSpec("json_schema", json.dumps(OBJ)))
    sampler = Sampler(seed=1, grammar=backend)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0)]
    outs: list[list[int]] = [[], [], []]
    for _ in range(12):
        logits = torch.randn(3, tok.vocab_size) * 4
        ref0 = _reference_allowed(tok, llg.LLMatcher.grammar_from_regex("[0-9]{4}"), outs[0])
        matchers = [regex.matcher if not regex.done() else None, schema.matcher if not schema.done() else None, None]
        mask = sampler.start_grammar_mask(matchers) if started else None
        got = sampler.sample(logits, params, outs, grammars=matchers, grammar_mask=mask).token_ids.tolist()
        if matchers[0] is not None:
            expect = int(torch.argmax(logits[0].masked_fill(~ref0, float("-inf"))))
            assert got[0] == expect
            outs[0].append(got[0])
            assert regex.sync(outs[0])
        if matchers[1] is not None:
            outs[1].append(got[1])
            assert schema.sync(outs[1]), schema.error
        assert got[2] == int(torch.argmax(logits[2]))
    text0 = tok.decode(outs[0])
    assert regex.done() and len(text0) == 4 and text0.isdigit()
    assert schema.done() and json.loads(tok.decode(outs[1]))["a"] in range(10)


def test_a_refused_token_is_a_dead_end(backend: Any, tok: Tokenizer) -> None:
    st = _ready_state(backend, GrammarSpec("regex", "[0-9]+"))
    letters = tok.encode("x", add_special_tokens=False)
    assert not st.sync(letters)
    assert st.error is not None and "dead end" in st.error and st.consumed == 0


def test_bench_json_schema_reaches_both_endpoints_and_never_closes_early(tok: Tokenizer, backend: Any) -> None:
    """pdcluster bench --json-schema: the schema goes into /generate's sampling_params and the
    completions endpoint's response_format; 'bench' cannot complete within any --output-len."""
    from common.tools.bench_client import Target, request_body
    from common.tools.bench_run import bench_schema
    from common.tools.bench_workload import BenchRequest

    schema = bench_schema("bench")
    assert schema is not None and bench_schema(None) is None
    req = BenchRequest(index=0, input_ids=[1, 2], output_len=64, arrival_s=0.0)
    gen = request_body(req, Target(url="u", json_schema=schema))
    assert gen["sampling_params"]["json_schema"] == schema and gen["sampling_params"]["ignore_eos"]
    comp = request_body(req, Target(url="u", endpoint="completions", json_schema=schema))
    assert comp["response_format"]["json_schema"]["schema"] == json.loads(schema)
    assert "json_schema" not in request_body(req, Target(url="u"))["sampling_params"]
    st = _ready_state(backend, GrammarSpec("json_schema", schema))
    item = tok.encode('{"id":12,"tag":"red"},', add_special_tokens=False)
    assert st.sync(tok.encode("[", add_special_tokens=False) + item * 40) and not st.done()
