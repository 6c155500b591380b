"""Finish checks run by the scheduler after each token it appends to a request.

Order (first hit wins)::

    last token in EOS ids (unless ignore_eos)  -> stop, matched=<token id>
    last token in stop_token_ids               -> stop, matched=<token id>
    a stop string appears in the output text   -> stop, matched=<stop string>
    len(output_ids) >= max_new_tokens          -> length

A request whose last allowed token is EOS or completes a stop string ended on its own, so it
reports "stop" rather than "length" (SGLang and vLLM check length first; the token ids are the
same either way, only the reason differs).

Stop strings are matched on decoded *output* text (never the prompt). Only a tail of the output is
decoded each step: a match must end inside the newest token's text and spans at most ``B`` bytes
(``B`` = the stop string's UTF-8 length), so with byte-level vocabularies (every token decodes to
at least one byte) it starts within the last ``B`` tokens. ``_TAIL_MARGIN`` extra tokens absorb
what goes wrong at the start of a decode window (a character split by the window edge decodes as
U+FFFD, a SentencePiece decoder drops the first token's leading space) and the odd token that
decodes to nothing (a skipped special token inside a stop string).

The text the client sees is cut by ``common.tokenizer.IncrementalDetokenizer``, which finds the
same first occurrence in the same decoded text.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from common.request import FinishReason, SamplingParams

# decode(ids, skip_special_tokens) -> text; ``common.tokenizer.Tokenizer.decode`` fits.
DecodeFn = Callable[[Sequence[int], bool], str]

_TAIL_MARGIN = 4


def find_stop_str(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``start`` of any of ``stops`` in ``text``: (index, string).

    Two stop strings starting at the same index: the first one listed wins (the cut is the same).
    """
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


class StopChecker:
    """Plain data in, plain data out: ``check(params, output_ids)`` after each appended token.

    ``eos_token_ids``: every id that ends generation for this model (generation_config.json's
    eos_token_id list plus the tokenizer's eos; see ``Tokenizer.eos_token_ids``).
    ``decode``: needed only for requests with stop strings.
    """

    def __init__(self, eos_token_ids: Iterable[int], decode: DecodeFn | None = None) -> None:
        self._eos = frozenset(eos_token_ids)
        self._decode = decode

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def check(self, params: SamplingParams, output_ids: Sequence[int]) -> FinishReason | None:
        """Why the request finished with ``output_ids[-1]`` as its newest token, or None."""
        if not output_ids:
            return None
        last = output_ids[-1]
        if not params.ignore_eos and last in self._eos:
            return FinishReason(type="stop", matched=last)
        if last in params.stop_token_ids:
            return FinishReason(type="stop", matched=last)
        if params.stop:
            hit = self._match_stop_str(params, output_ids)
            if hit is not None:
                return FinishReason(type="stop", matched=hit)
        if len(output_ids) >= params.max_new_tokens:
            return FinishReason(type="length", length=params.max_new_tokens)
        return None

    def _match_stop_str(self, params: SamplingParams, output_ids: Sequence[int]) -> str | None:
        if self._decode is None:
            raise ValueError("StopChecker needs a decode function for requests with stop strings")
        window = max(len(s.encode("utf-8")) for s in params.stop) + _TAIL_MARGIN
        tail = self._decode(output_ids[-window:], params.skip_special_tokens)
        hit = find_stop_str(tail, params.stop)
        return hit[1] if hit is not None else None
