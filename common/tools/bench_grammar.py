"""What a grammar costs a node, engine alone: ``python -m common.tools.bench_grammar --model-path M``.

    tokenizer trie       built once per node from its tokenizer (the backend's start-up cost)
    cold                 a request's wait until its matcher is ready, for a spec never seen
                         (compiled on the cache's pool) and its first token mask
    cached               the same for a spec compiled before (an LRU hit: a matcher copy)

Specs: the bench schema of ``pdcluster bench --json-schema bench``, an order schema with ``$ref``
and bounds (what ``client.beta.chat.completions.parse`` sends for a small pydantic model), a regex,
and any ``--schema FILE`` given. Medians of ``--repeat`` runs, each on a fresh cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.grammar.backend import bitmask_width
from common.grammar.cache import GrammarCache
from common.grammar.factory import load_backend
from common.grammar.spec import GrammarSpec
from common.grammar.state import GrammarState
from common.tools.bench_run import BENCH_SCHEMA

ORDER = {"$defs": {"Item": {"type": "object", "properties": {
    "color": {"enum": ["red", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"], "additionalProperties": False}},
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                     "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 3},
                                     "rush": {"type": "boolean"}},
    "required": ["id", "items", "rush"], "additionalProperties": False}


def _ready(cache: GrammarCache, spec: GrammarSpec, vocab: int) -> tuple[float, float]:
    """(ms until the request's matcher is ready, ms of its first mask)."""
    t0 = time.perf_counter()
    st = GrammarState.start(cache, spec)
    while st.poll(time.monotonic()) == "pending":
        time.sleep(0.0001)
    ready = time.perf_counter() - t0
    mask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    t0 = time.perf_counter()
    cache.backend.fill_bitmask([(st.matcher, 0)], mask)  # type: ignore[list-item]
    return ready * 1e3, (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.tools.bench_grammar", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="checkpoint directory (its tokenizer and vocab size)")
    ap.add_argument("--schema", action="append", default=[], metavar="FILE", help="also time this JSON schema")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    from common.tokenizer import Tokenizer

    tok = Tokenizer(a.model_path)
    with open(f"{a.model_path}/config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    t0 = time.perf_counter()
    backend = load_backend("llguidance", tok.backend_json(), vocab, sorted(tok.eos_token_ids), threads=1)
    assert backend is not None
    print(f"tokenizer trie: {(time.perf_counter() - t0) * 1e3:.1f} ms (vocab {vocab}, once per node)")
    specs = {"bench schema": GrammarSpec("json_schema", json.dumps(BENCH_SCHEMA)),
             "order schema": GrammarSpec("json_schema", json.dumps(ORDER)),
             "regex": GrammarSpec("regex", "(cache|node|room)-[0-9]{2,4}")}
    for path in a.schema:
        with open(path) as f:
            specs[path] = GrammarSpec("json_schema", f.read())
    print(f"{'spec':<16} {'cold ready':>11} {'cold mask':>10} {'cached ready':>13} {'cached mask':>12}   (ms, median of {a.repeat})")
    for name, spec in specs.items():
        rows = []
        for _ in range(a.repeat):
            cache = GrammarCache(backend, threads=1)
            rows.append((*_ready(cache, spec, vocab), *_ready(cache, spec, vocab)))
            cache.close()
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"{name:<16} {med[0]:>11.3f} {med[1]:>10.3f} {med[2]:>13.3f} {med[3]:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
