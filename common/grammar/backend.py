"""The interface a grammar library plugs in behind, and where a backend is chosen.

Three costs, three calls, each on the thread that can afford it::

    check(spec)            parse time, API process: does the spec compile at all? (no tokenizer;
                           cheap, cached) -> the 400's reason, or None
    compile(spec)          scheduler's compile pool: the spec against this node's vocabulary ->
                           an opaque compiled grammar, kept in the LRU (GrammarCache)
    matcher(compiled)      scheduler loop: a fresh per-request matcher from a compiled grammar
                           (a copy, microseconds)
    fill_bitmask(rows, m)  sampler: the allowed-token bitmask of several matchers at once into
                           ``m`` (int32 [B, ceil(V/32)], bit t of row b: token t allowed)

A ``Matcher`` consumes the tokens a request emits and says when the grammar is complete.
llguidance (``common.grammar.llg``) is the one shipped (``common.grammar.factory`` picks it); xgrammar would fit the same calls
(``GrammarCompiler.compile_*`` / ``GrammarMatcher`` / ``fill_next_token_bitmask``).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from common.grammar.spec import GrammarSpec

if TYPE_CHECKING:  # the API process imports this module for check_spec's types, without torch
    import torch


class GrammarError(Exception):
    """A spec that cannot be compiled (the message says why); the request gets a 400."""


class Matcher(Protocol):
    def consume(self, token_id: int) -> bool:
        """Advance by one emitted token; False: the grammar does not allow it (the matcher is dead)."""
        ...

    def is_done(self) -> bool:
        """The grammar is complete: nothing but an end token may follow."""
        ...

    def error(self) -> str:
        """Why the matcher is dead ("" while it is not)."""
        ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int  # bitmask width in tokens: the model's logits width

    def check(self, spec: GrammarSpec) -> str | None: ...

    def compile(self, spec: GrammarSpec) -> Any:
        """Raises GrammarError."""
        ...

    def matcher(self, compiled: Any) -> Matcher: ...

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None: ...


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] bitmask -> bool [B, vocab_size] (bit t % 32 of word t // 32 is token t)."""
    import torch  # the scheduler's side only (the API process imports this module without torch)

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [B, V]


def refused_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] bitmask -> bool [B, vocab_size], True where the token is NOT allowed: what
    the sampler fills with -inf.

    On the host it is one numpy pass over the bitmask's bytes: the tensor path of
    ``allowed_from_bitmask`` is half a dozen small ops (shift, and, reshape, slice, cast, invert)
    that cost a CPU node's decode step more than llguidance's mask itself (0.5 ms for 32 rows
    against 0.45, measured). A device keeps the tensor path (the bitmask moves, not the bools)."""
    import numpy as np
    import torch

    if not bitmask.is_cpu or sys.byteorder != "little":
        return ~allowed_from_bitmask(bitmask, vocab_size)
    # Little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit first.
    raw = np.invert(bitmask.numpy().view(np.uint8))  # [B, 4W]
    bits = np.unpackbits(raw, axis=1, count=vocab_size, bitorder="little")  # [B, V] uint8 0/1
    return torch.from_numpy(bits).view(torch.bool)  # [B, V]
