"""Constrained decoding: grammar specs, a pluggable backend, the compile cache, per-request state.

    spec.py      GrammarSpec (json_schema | regex | ebnf) read from SamplingParams; parse-time checks
    backend.py   the interface a grammar library plugs in behind (compile, matcher, batched bitmask)
    llg.py       the llguidance backend (the one shipped)
    factory.py   the backend a node uses (--grammar-backend), the API process's parse-time check
    cache.py     GrammarCache: compiled once per spec, bounded LRU, compiled on a thread pool
    state.py     GrammarState: one request's matcher, advanced by every output token

docs/ARCHITECTURE.md ("Structured outputs") says where each piece runs and how the state crosses PD.
"""
