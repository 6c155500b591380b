"""What the cache-aware policies match a request on: its prompt as text (the character tree, used
without a tokenizer) and, with ``--tokenizer-path``, as token ids, the way the nodes tokenize it.

    /generate        text -> encode(text) (special tokens added, as the nodes do); input_ids as given
    /v1/completions  prompt: the same
    /v1/chat/...     messages rendered with the model's chat template as the nodes render it
                     (router/chat_template.py, jinja2), encoded without adding special tokens;
                     no template (or one that fails here): no ids, routed by load
A batch is keyed on its first prompt (as the character tree always was).

The router only needs the ``tokenizers`` library (Rust, no torch or transformers): it reads the
model's ``tokenizer.json``. A prompt the router tokenizes differently from the node only costs a
wrong prediction (measured: ``pdc_router_kv_predictions_total``), never a wrong answer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from common.kv_events import ROOT_HASH, block_hashes
from common.pd_contract import all_ints

_GIL_FREE_CHARS = 16384  # longer texts are encoded through encode_batch (GIL released)


@dataclass
class RouteKey:
    text: str | None  # the character tree's key (router/parse.py)
    tokens: list[int] | None  # the prompt's token ids; None: not known (no tokenizer, or untokenizable)
    predicted: dict[str, int] = field(default_factory=dict)  # prefill URL -> predicted cached tokens
    decode_predicted: dict[str, int] = field(default_factory=dict)  # decode URL -> predicted reused tokens
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def predictions(self, role: str) -> dict[str, int]:
        """The last pick's predicted hits per worker of ``role`` (each role's pick keeps its own)."""
        return self.predicted if role == "prefill" else self.decode_predicted

    def salt(self) -> int:
        """The prompt's first 16 tokens, hashed: what the tie-break between equal workers keys on
        (prompts that share their start share their order of workers)."""
        assert self.tokens is not None
        head = self.tokens[:16]
        return block_hashes(head, len(head))[0] if head else ROOT_HASH

    def hashes(self, block_size: int) -> list[int]:
        """Chained block hashes of the prompt's blocks the node could serve from its cache: at
        least one token is always computed, so the last token's block never counts."""
        h = self._hashes.get(block_size)
        if h is None:
            assert self.tokens is not None
            usable = max(0, len(self.tokens) - 1) // block_size * block_size
            h = self._hashes[block_size] = block_hashes(self.tokens[:usable], block_size)
        return h


class PromptTokenizer:
    """The model's ``tokenizer.json`` (``path``: the file or its directory) and the chat template
    beside it, if any."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer  # imported here: only a router with --tokenizer-path needs it

        file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        self.path = file
        self._tok = Tokenizer.from_file(file)
        from router.chat_template import ChatTemplate

        self._chat = ChatTemplate.load(os.path.dirname(file))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Only the batch binding releases the GIL while Rust works (as common/tokenizer/hf.py
        # found): a long prompt, tokenized in a worker thread, must not stall the event loop.
        if len(text) > _GIL_FREE_CHARS:
            return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def prompt_ids(self, endpoint: str, body: dict) -> list[int] | None:
        """The first prompt of a request (already checked by ``router.parse.inspect``) as token ids;
        None where it cannot tell (a chat without a template it can render) or for ids no node
        would take (outside uint32: they cannot be hashed)."""
        ids = self._ids(endpoint, body)
        if ids is None or any(not 0 <= t < 1 << 32 for t in ids):
            return None
        return ids

    def _ids(self, endpoint: str, body: dict) -> list[int] | None:
        if endpoint == "chat":
            text = None if self._chat is None else self._chat.render(body.get("messages"))
            return None if text is None else self.encode(text, add_special_tokens=False)
        value: Any = body.get("input_ids") if endpoint == "generate" and body.get("input_ids") is not None else \
            body.get("text") if endpoint == "generate" else body.get("prompt")
        if isinstance(value, str):
            return self.encode(value)
        if isinstance(value, list) and value:
            first = value[0]
            if isinstance(first, str):
                return self.encode(first)
            if all_ints(value):
                return list(value)
            if isinstance(first, list) and all_ints(first):
                return list(first)
        return None
