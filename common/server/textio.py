"""The slice of the tokenizer the API process uses, and the detokenizer it builds per sequence.

``TokenizerLike`` is what ``common.tokenizer.Tokenizer`` offers and the server calls (a Protocol,
so tests may pass a stand-in). Detokenization is ``common.tokenizer.IncrementalDetokenizer``:
it holds back unfinished UTF-8 and any tail that may still grow into a stop string, and cuts
the text at the first stop string (the scheduler stops generating there too).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from common.tokenizer import IncrementalDetokenizer

# The detokenizer decodes a few prompt ids before the output and drops their text, so that a
# SentencePiece tokenizer keeps the first output token's leading space (SGLang uses 5).
_CONTEXT_IDS = 5


class TokenizerLike(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, **template_kwargs: Any) -> list[int] | str: ...


def new_detokenizer(tok: TokenizerLike, prompt_ids: Sequence[int], stop: Sequence[str],
                    skip_special_tokens: bool) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=skip_special_tokens,
                                  context_ids=prompt_ids[-_CONTEXT_IDS:])


def token_piece(tok: TokenizerLike, token_id: int) -> str:
    """The text of one token as logprob listings show it (special tokens included)."""
    return tok.decode([token_id], skip_special_tokens=False)
