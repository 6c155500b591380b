"""Grammars compiled once per spec, off the scheduler loop, kept in a bounded LRU.

::

    scheduler loop                           compile pool (threads)
    handle = cache.get(spec, now)  ──miss──> backend.compile(spec) ──> LRU[spec.key]; listener()
       │ hit: ready at once; in flight: shares that compile
    handle.poll(now) -> "pending" | "ready" | "failed"   (never blocks)
       failed: the compile raised, or has not finished ``timeout_s`` after this request asked

The loop never waits for a compile: a request whose grammar is pending stays in its queue and
the batch runs without it; ``listener`` (the node loop's wake-up) is called when a compile ends,
so the request moves at the next turn. A compile that outlives its timeout fails the requests
waiting for it (400) but keeps its thread until it ends (a thread cannot be stopped); the
backend's own limits (llguidance's parser fuel) bound how long that is. Failed compiles are not
cached: the API process rejects most bad specs before they get here.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from common.grammar.backend import GrammarBackend, GrammarError, Matcher
from common.grammar.spec import GrammarSpec

log = logging.getLogger(__name__)

Status = Literal["pending", "ready", "failed"]


@dataclass
class GrammarHandle:
    """One request's claim on a compiled grammar."""

    spec: GrammarSpec
    deadline: float  # clock time after which a pending compile fails this request
    _future: Future | None = None
    _compiled: Any = None
    error: str | None = None

    def poll(self, now: float) -> Status:
        if self.error is not None:
            return "failed"
        if self._compiled is not None:
            return "ready"
        fut = self._future
        assert fut is not None
        if fut.done():
            exc = fut.exception()
            if exc is None:
                self._compiled = fut.result()
                return "ready"
            self.error = str(exc) if isinstance(exc, GrammarError) else f"grammar compile failed: {type(exc).__name__}: {exc}"
            return "failed"
        if now > self.deadline:
            self.error = f"the {self.spec.kind} did not compile within the grammar compile timeout; simplify it"
            return "failed"
        return "pending"

    @property
    def compiled(self) -> Any:
        assert self._compiled is not None, "poll() the handle until it is ready"
        return self._compiled


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_failures: int = 0
    compile_seconds: float = 0.0  # summed over finished compiles
    evictions: int = 0


def _same(value: int) -> int:
    return value


class GrammarCache:
    """``backend``'s compiled grammars by spec: at most ``capacity`` kept (least recently used
    evicted), compiled on ``threads`` pool threads, each request waiting at most ``timeout_s``."""

    def __init__(self, backend: GrammarBackend, capacity: int = 256, threads: int = 2, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.capacity = max(1, capacity)
        self.timeout_s = timeout_s
        # TP nodes: the MIN over the ranks of a grammar's compile outcome (common/grammar/state.py).
        self.agree_min: Callable[[int], int] = _same
        self.clock = clock
        self.stats = CacheStats()
        self._lru: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # _lru and stats are written by pool threads too
        self._listener: Callable[[], None] | None = None

    def set_listener(self, listener: Callable[[], None]) -> None:
        """Called (from a pool thread) whenever a compile ends: the node loop's wake-up."""
        self._listener = listener

    def get(self, spec: GrammarSpec, now: float | None = None) -> GrammarHandle:
        now = self.clock() if now is None else now
        handle = GrammarHandle(spec, deadline=now + self.timeout_s)
        key = spec.key
        with self._lock:
            compiled = self._lru.get(key)
            if compiled is not None:
                self._lru.move_to_end(key)
                self.stats.hits += 1
                handle._compiled = compiled
                return handle
            fut = self._inflight.get(key)
            if fut is None:
                self.stats.misses += 1
                fut = self._inflight[key] = self._pool.submit(self._compile, spec)
                fut.add_done_callback(self._notify)
            else:
                self.stats.hits += 1  # compiled once for both
        handle._future = fut
        return handle

    def matcher(self, handle: GrammarHandle) -> Matcher:
        return self.backend.matcher(handle.compiled)

    def __len__(self) -> int:
        return len(self._lru)

    def metrics(self) -> dict[str, float]:
        """For /metrics (``pdc_scheduler_grammar_*``): what the cache holds and has done."""
        with self._lock:
            st = self.stats
            return {"grammar_cache_entries": float(len(self._lru)), "grammar_compiles_inflight": float(len(self._inflight)),
                    "grammar_cache_hits_total": float(st.hits), "grammar_cache_misses_total": float(st.misses),
                    "grammar_cache_evictions_total": float(st.evictions),
                    "grammar_compile_failures_total": float(st.compile_failures),
                    "grammar_compile_seconds_total": st.compile_seconds}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        t0 = time.perf_counter()
        try:
            compiled = self.backend.compile(spec)
        except BaseException:
            with self._lock:
                self.stats.compile_failures += 1
                self._inflight.pop(spec.key, None)
            raise
        took = time.perf_counter() - t0
        with self._lock:
            self.stats.compile_seconds += took
            self._lru[spec.key] = compiled
            self._lru.move_to_end(spec.key)
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
                self.stats.evictions += 1
            self._inflight.pop(spec.key, None)
        log.debug("compiled %s in %.1f ms", spec.describe(), took * 1e3)
        return compiled

    def _notify(self, _fut: Future) -> None:
        if self._listener is not None:
            try:
                self._listener()
            except Exception:  # waking the loop is best effort: it polls anyway
                log.exception("grammar listener failed")
