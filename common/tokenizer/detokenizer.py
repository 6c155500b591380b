"""Token ids in, newly *stable* text out: what a streaming response may send without retracting.

Two windows over the ids (the prefix/read offsets vLLM and SGLang use)::

    ids:   c c c | o o o o o o | o o o
                 ^prefix       ^read  ^len(ids)
    prefix_text = decode(ids[prefix:read])      text already emitted for those ids
    new_text    = decode(ids[prefix:])          the same plus what the new ids add
    delta       = new_text[len(prefix_text):]

Decoding a few already-emitted ids together with the new ones is what makes byte-level BPE
merges and SentencePiece's leading-space handling come out as in ``decode(all_ids)``. The delta
is held back while ``new_text`` ends in U+FFFD: the last ids end in an incomplete UTF-8 sequence
that a later id may complete. (A genuinely invalid byte is released with the next id, or at
finish.)

Stop strings: the stable text is searched for the earliest stop string; the text is cut there and
nothing after it is ever returned. Until then any suffix that could be the start of a stop string
is held back, so no part of a stop string is ever streamed. ``finish`` releases whatever is held
(an unfinished stop-string prefix was ordinary text after all).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from common.request import FinishReason
from common.sched.stop import find_stop_str

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """One per request (or per choice when n > 1), fed in order; not thread-safe.

    ``context_ids``: the last few prompt ids (SGLang uses 5). They are decoded with the output
    but never returned, so the first output token's leading space survives SentencePiece's
    strip-at-start. Without them the text equals ``decode(output_ids)`` exactly.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""  # stable output text, cut at a stop string once one is found
        self._scanned = 0  # stop strings starting before this index of _text were ruled out
        self._emitted = 0  # chars of _text already returned
        self._done = False

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._emitted]

    @property
    def finished(self) -> bool:
        """True after finish, or once a stop string was found (later ids are ignored)."""
        return self._done

    def add(self, ids: Sequence[int], finish: FinishReason | None = None) -> str:
        """Feed the request's newest ids; return the text they make stable.

        Pass the request's FinishReason with the ids of the step that finished it: a matched
        stop *token* (the last id) is left out of the text, a matched stop string is cut, and
        everything still held back is released.
        """
        if self._done:
            return ""
        new = list(ids)
        if finish is not None and finish.type == "stop" and isinstance(finish.matched, int):
            if new and new[-1] == finish.matched:
                new.pop()
        self._ids.extend(new)
        final = finish is not None
        self._advance(final)
        return self._release(final)

    def _advance(self, final: bool) -> None:
        if self._read >= len(self._ids):
            return
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(new_text) <= len(prefix_text):
            return  # ids that decode to nothing (skipped specials) or half a character
        if new_text.endswith(_REPLACEMENT) and not final:
            return
        self._text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if self._stop and end > self._scanned:
            # A stop string found now must end in the new text, so it starts at most
            # max_stop - 1 chars before it.
            hit = find_stop_str(self._text, self._stop, max(0, self._scanned - self._max_stop + 1))
            if hit is not None:
                self._text = self._text[: hit[0]]
                end = hit[0]
                final = True
            self._scanned = len(self._text)
        if self._stop and not final:
            end -= stop_prefix_len(self._text, self._stop)
        if final:
            self._done = True
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
