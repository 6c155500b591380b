"""The structured-output acceptance run, shared by every topology (2P2D behind our router, a 1P1D
pair, sglang-router): 20 JSON schemas (nested objects, arrays, enums, bounded numbers, required and
optional properties, ``$ref``, ``anyOf``/``oneOf``, ``prefixItems``, patterns), a plan of requests
over them (streamed and not, greedy and sampled), and the checks: every answer finishes, parses
and validates with ``jsonschema``; greedy answers of a schema agree with each other and equal HF
generate with the grammar as a logits processor (tests/reference.py), token for token up to the
first near-tie.

Every string and array is bounded: a random-weight model fills whatever room a schema leaves, and
an unbounded string would run into ``max_tokens`` (finish_reason length, JSON cut short) rather
than complete. Non-integer numbers carry a ``multipleOf`` a binary float holds exactly, so the
digits end and ``jsonschema``'s float division agrees.

``GRAMMAR_REQUESTS`` sets how many requests each topology sends (``make grammar-acceptance`` runs
200); unset, each test sends its CI-sized default.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

NAME = {"type": "string", "maxLength": 6}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": NAME},
                 "required": ["id", "name"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["x", "p"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "note": NAME, "flag": {"type": "boolean"}},
                 "required": ["id"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                               {"enum": ["none", "many"]}]}},
               "required": ["v"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["k", "n"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "top_level_enum": {"enum": ["alpha", "beta", 7, True]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "const_and_null": {"type": "object", "properties": {"kind": {"const": "event"}, "at": {"type": ["integer", "null"],
                                                                                           "minimum": 0, "maximum": 60}},
                       "required": ["kind", "at"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                        "minItems": 1, "maxItems": 5},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["lo", "hi"]},
                                               {"type": "boolean"}], "items": False, "minItems": 3},
    "exclusive_bounds": {"type": "object", "properties": {
        "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "h": {"type": "number", "minimum": -2, "maximum": 2, "multipleOf": 0.5}},
        "required": ["n", "h"], "additionalProperties": False},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False},
    "nullable_object": {"type": "object", "properties": {"owner": {"anyOf": [
        {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
        {"type": "null"}]}}, "required": ["owner"], "additionalProperties": False},
    "all_optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2, 3]}, "c": NAME},
                     "additionalProperties": False},
    "ref_in_array": {"$defs": {"tag": {"type": "object", "properties": {"key": {"enum": ["os", "arch"]}, "val": NAME},
                                       "required": ["key", "val"], "additionalProperties": False}},
                     "type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"},
                                                               "minItems": 1, "maxItems": 2}},
                     "required": ["tags"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4},
                                                        "level": {"enum": ["debug", "info", "warn"]}},
                       "required": ["code", "level"], "additionalProperties": False},
}
assert len(SCHEMAS) == 20

MAX_TOKENS = 160
# (stream, greedy) in the order a schema's successive requests take them.
MODES = ((False, True), (True, True), (True, False), (False, False))


def requests_from_env(default: int) -> int:
    """``GRAMMAR_REQUESTS`` or the test's CI-sized default."""
    return int(os.environ.get("GRAMMAR_REQUESTS", str(default)))


@dataclass(frozen=True)
class Job:
    i: int
    name: str
    stream: bool
    greedy: bool

    @property
    def messages(self) -> list[dict]:
        # The greedy requests of a schema share a prompt (one HF reference); sampled ones differ.
        return [{"role": "user", "content": f"record {'g' if self.greedy else self.i} as JSON ({self.name})"}]

    def body(self, model: str) -> dict:
        """The OpenAI chat body (without ``stream``)."""
        fmt = {"type": "json_schema", "json_schema": {"name": self.name, "schema": SCHEMAS[self.name], "strict": True}}
        sampling = {"temperature": 0} if self.greedy else {"temperature": 1.0, "seed": 100 + self.i}
        return {"model": model, "messages": self.messages, "max_tokens": MAX_TOKENS, "response_format": fmt, **sampling}

    def __str__(self) -> str:
        return f"#{self.i} {self.name} stream={self.stream} greedy={self.greedy}"


def plan(n: int) -> list[Job]:
    """``n`` requests: request i takes schema i % 20 and the mode that schema is at, starting one
    mode further per schema, so 20 requests already mix all four modes and any 3 consecutive
    modes of a schema include a greedy one (60 requests: a greedy reference for every schema)."""
    names = list(SCHEMAS)
    jobs = []
    for i in range(n):
        s, rnd = i % len(names), i // len(names)
        stream, greedy = MODES[(s + rnd) % len(MODES)]
        jobs.append(Job(i, names[s], stream, greedy))
    return jobs


def run(jobs: list[Job], send: Callable[[Job], tuple[str, str | None]], concurrency: int = 32) -> list[tuple[str, str | None]]:
    """(text, finish_reason) per job, ``concurrency`` at a time (constrained rows share batches)."""
    with ThreadPoolExecutor(min(concurrency, len(jobs))) as ex:
        return list(ex.map(send, jobs))


@functools.lru_cache(maxsize=64)
def _hf_reference(model_dir: str, prompt: tuple[int, ...], name: str) -> tuple[list[int], list[float]]:
    # One per (checkpoint, prompt, schema) for the whole session: every topology asks the same.
    from tests.reference import hf_greedy_constrained

    return hf_greedy_constrained(model_dir, list(prompt), MAX_TOKENS, "json_schema", json.dumps(SCHEMAS[name]))


def check(jobs: list[Job], results: list[tuple[str, str | None]], model_dir: str, tok: Any, near_tie: float) -> None:
    """Every answer finished, parses and validates; the greedy answers of a schema are equal, and
    equal HF generate under the same grammar (up to the first near-tie step, then only before it)."""
    import jsonschema

    greedy_text: dict[str, str] = {}
    for job, (text, finish) in zip(jobs, results):
        assert finish == "stop", f"{job}: finish {finish}, text {text!r}"
        jsonschema.validate(json.loads(text), SCHEMAS[job.name])
        if not job.greedy:
            continue
        if job.name in greedy_text:
            assert text == greedy_text[job.name], f"{job}: {text!r}, another greedy one {greedy_text[job.name]!r}"
            continue
        greedy_text[job.name] = text
        prompt = tuple(tok.apply_chat_template(job.messages, add_generation_prompt=True))
        want, gaps = _hf_reference(model_dir, prompt, job.name)
        tie = next((k for k, g in enumerate(gaps[: len(want)]) if g < near_tie), len(want))
        # Text, not ids: re-encoding an answer need not give the ids the model chose.
        assert text.startswith(tok.decode(want[:tie])), f"{job}: got {text!r}, HF {tok.decode(want)!r}"
        assert tie < len(want) or text == tok.decode(want), f"{job}: got {text!r}, HF {tok.decode(want)!r}"


def sse_chat(events: list[dict]) -> tuple[str, str | None]:
    """(text, finish_reason) of a streamed chat answer's decoded SSE events."""
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices"))
    finish = next((e["choices"][0]["finish_reason"] for e in events if e.get("choices")
                   and e["choices"][0].get("finish_reason")), None)
    return text, finish
