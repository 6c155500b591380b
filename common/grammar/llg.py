"""The llguidance backend (``pip install llguidance``: one abi3 wheel, no dependencies).

Why llguidance rather than xgrammar: its wheel needs nothing else (xgrammar pulls torch builds,
transformers and more into every image, the router's excepted), it compiles a grammar lazily
(the lexer is built as the mask is computed, so a new schema costs well under a millisecond to
"compile" and the first masks a little more), it supports JSON schema beyond OpenAI's strict
subset (``$ref``, ``anyOf``, numeric bounds, ``pattern``, formats) and refuses keywords it does
not implement instead of ignoring them, and it takes the tokenizer's serialized form straight
from the ``tokenizers`` object we already hold.

JSON is compact by default here (no whitespace between tokens, ``,`` and ``:`` separators): a
model left free to emit whitespace can pad forever before the schema completes, and compact
output is what OpenAI's structured outputs return. A schema opts back in with
``"x-guidance": {"whitespace_flexible": true}`` (llguidance reads its options from there).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import torch

from common.grammar.backend import GrammarError, Matcher
from common.grammar.spec import GrammarSpec

_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
# Errors name the problem, not llguidance's internal state dump (which echoes the whole grammar).
_LIMITS_KW: dict[str, Any] = {"verbose_errors": False}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec``; raises GrammarError for text that is not even parseable."""
    try:
        if spec.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.text)
        return llg.grammar_from("ebnf", spec.text)  # GBNF (SGLang/xgrammar's EBNF) or Lark
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def _first_line(msg: str) -> str:
    # llguidance's messages may continue with a caret diagram; the first lines carry the reason.
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:4])[:500]


@functools.lru_cache(maxsize=256)
def _check_cached(kind: str, text: str) -> str | None:
    spec = GrammarSpec(kind, text)  # type: ignore[arg-type]
    try:
        grammar = grammar_text(spec)
    except GrammarError as exc:
        return f"invalid {spec.kind}: {_first_line(str(exc))}"
    msg = llg.LLMatcher.validate_grammar(grammar, None, limits=llg.LLParserLimits(**_LIMITS_KW))
    return f"invalid {spec.kind}: {_first_line(msg)}" if msg else None


def check(spec: GrammarSpec) -> str | None:
    """Why ``spec`` cannot compile (an invalid schema, an unimplemented keyword, a regex or grammar
    that does not parse), or None. No tokenizer: what depends on the vocabulary is the node's."""
    return _check_cached(spec.kind, spec.text)


class _LLMatcher:
    __slots__ = ("m",)

    def __init__(self, m: llg.LLMatcher) -> None:
        self.m = m

    def consume(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id))

    def is_done(self) -> bool:
        return bool(self.m.is_stopped()) and not self.m.is_error()

    def error(self) -> str:
        return _first_line(self.m.get_error()) if self.m.is_error() else ""


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], threads: int) -> None:
        # Built once per node (~10 ms for a small vocabulary, ~1 s for 150k tokens): the token trie
        # every mask walks. n_vocab is the logits width, so padded rows of the embedding are masked.
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._executor = llg.LLExecutor(max(1, threads))
        self._limits = llg.LLParserLimits(**_LIMITS_KW)

    def check(self, spec: GrammarSpec) -> str | None:
        return check(spec)

    def compile(self, spec: GrammarSpec) -> llg.LLMatcher:
        """A matcher at the grammar's start, kept as the template each request copies."""
        m = llg.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0, limits=self._limits)
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_first_line(m.get_error())}")
        return m

    def matcher(self, compiled: llg.LLMatcher) -> Matcher:
        return _LLMatcher(compiled.deep_copy())

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """All rows' masks in one call, computed on llguidance's own threads (the GIL released)."""
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        batch, width = bitmask.shape
        pairs = [(m.m, i) for m, i in rows]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), width * 4, batch)
