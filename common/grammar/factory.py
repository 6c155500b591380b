"""Which grammar backend a node and its API process use (``--grammar-backend``)."""
from __future__ import annotations

from collections.abc import Sequence

from common.grammar.backend import GrammarBackend
from common.grammar.spec import GrammarSpec

BACKENDS = ("llguidance", "none")


def check_spec(spec: GrammarSpec, backend: str = "llguidance") -> str | None:
    """Parse-time check (API process): why ``spec`` cannot compile, or None."""
    if backend == "none":
        return "structured outputs are turned off on this server (--grammar-backend none)"
    from common.grammar.llg import check

    return check(spec)


def load_backend(name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 threads: int) -> GrammarBackend | None:
    """The node's backend over its tokenizer (built once per node), or None for ``none``."""
    if name == "none":
        return None
    if name == "llguidance":
        from common.grammar.llg import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer_json, vocab_size, eos_token_ids, threads)
    raise ValueError(f"unknown grammar backend {name!r}: expected one of {', '.join(BACKENDS)}")
