"""What a request constrains its output to, read from its ``SamplingParams``.

A spec is plain text (a JSON schema as JSON, a regex, an EBNF/Lark grammar), so it travels inside
the request exactly as the client sent it: the prefill and the decode read the same body from the
router and compile the same spec. Its ``key`` names it in the compile caches.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from common.request import InvalidRequest, SamplingParams

Kind = Literal["json_schema", "regex", "ebnf"]
KINDS: tuple[Kind, ...] = ("json_schema", "regex", "ebnf")

# OpenAI's response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    kind: Kind
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    def describe(self) -> str:
        """A short name for logs and errors (never the whole spec: it may be large)."""
        head = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind} {head!r}"


def spec_of(params: SamplingParams) -> GrammarSpec | None:
    """The request's grammar, or None. ``SamplingParams.validate`` has checked there is at most one."""
    for kind in KINDS:
        text = getattr(params, kind)
        if text is not None:
            return GrammarSpec(kind, text)
    return None


def schema_text(v: Any, what: str) -> str:
    """A JSON schema given as an object (OpenAI) or as JSON text (SGLang's sampling_params) ->
    JSON text. Raises InvalidRequest when it is neither a JSON object nor a boolean schema."""
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError as exc:
            raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
        if not isinstance(parsed, (dict, bool)):
            raise InvalidRequest(f"{what} must be a JSON object")
        return v
    if isinstance(v, (dict, bool)):
        return json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    raise InvalidRequest(f"{what} must be a JSON object or a string holding one")
