"""One request's grammar state on one node: its compile handle, then its matcher.

The matcher must have seen every token the request emitted, wherever it was sampled::

    prefill: matcher fresh ─ mask ─> samples token 0 (the request ends there; the matcher with it)
    decode:  matcher fresh ─ sync(out = [token 0 from the aux row]) ─ mask ─> token 1 ─ sync ─> ...

``sync(out)`` consumes ``out[consumed:]``: the prefill's first token before the decode's first
step (the matcher may have compiled only after the KV landed, so the first token is caught up
whenever it is ready), then each new token. A retraction frees KV, never this state, so a
recomputed request keeps its matcher as is; a state rebuilt from scratch would replay all of
``out`` through the same call. A token the grammar refuses (a dead end: the mask left nothing,
or something other than the masked sampler chose it) kills the request with an error instead
of letting it emit text that does not match.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.grammar.backend import Matcher
from common.grammar.cache import GrammarCache, GrammarHandle, Status
from common.grammar.spec import GrammarSpec


# Ordered so the MIN over TP ranks is the node's answer: any failed -> failed; else any pending -> pending.
_RANK: dict[Status, int] = {"failed": 0, "pending": 1, "ready": 2}
_STATUS: dict[int, Status] = {v: k for k, v in _RANK.items()}


@dataclass
class GrammarState:
    cache: GrammarCache
    handle: GrammarHandle
    matcher: Matcher | None = None
    consumed: int = 0  # output tokens the matcher has seen
    error: str | None = None  # compile failure, timeout or dead end: the request ends with it

    @classmethod
    def start(cls, cache: GrammarCache, spec: GrammarSpec, now: float | None = None) -> GrammarState:
        return cls(cache, cache.get(spec, now))

    def poll(self, now: float) -> Status:
        """pending / ready (a matcher exists) / failed (``error`` says why); never blocks.

        On a TP node each rank compiles on its own threads, so the outcome is agreed
        (``GrammarCache.agree_min``): failed when any rank failed, ready only when every rank is,
        so every rank's scheduler admits (or fails) the request at the same step."""
        if self.error is not None:
            return "failed"
        if self.matcher is not None:
            return "ready"
        local = self.handle.poll(now)
        status = _STATUS[self.cache.agree_min(_RANK[local])]
        if status == "failed":
            self.error = self.handle.error if local == "failed" else "the grammar failed on another TP rank of this node"
        elif status == "ready":
            self.matcher = self.cache.matcher(self.handle)
        return status

    def sync(self, out: Sequence[int]) -> bool:
        """Advance the (ready) matcher by the tokens it has not seen. False: a dead end (``error``)."""
        m = self.matcher
        assert m is not None
        while self.consumed < len(out):
            tok = out[self.consumed]
            if not m.consume(tok):
                why = m.error() or "no further token is allowed"
                self.error = (f"grammar dead end: token {tok} at output position {self.consumed} does not "
                              f"match the {self.handle.spec.kind} ({why})")
                return False
            self.consumed += 1
        return True

    def done(self) -> bool:
        """The grammar is complete (only an end token could follow): the request stops here."""
        return self.matcher is not None and self.error is None and self.matcher.is_done()
