"""Which worker gets a request: one policy for the prefill role and one for the decode role.

Contract (``Policy.pick``): given the candidates — healthy, not draining, at least one — and
the request's prompt key (``RouteKey``: text and, with a tokenizer, token ids; None when there is
none), return one of them. ``on_routed`` is told where a request went; ``forget`` that a worker
left. A policy never blocks and never does I/O: loads are what ``Worker.load`` says now.
"""
from __future__ import annotations

import abc
import hashlib
import itertools
import random
from collections import Counter

from router.config import CacheAwareConfig
from router.kv_index import KVIndex
from router.prefix_tree import PrefixTree
from router.prompt_key import RouteKey
from router.workers import Worker


class Policy(abc.ABC):
    @abc.abstractmethod
    def pick(self, candidates: list[Worker], key: str | None) -> Worker: ...

    def on_routed(self, worker: Worker, key: str | None) -> None:  # noqa: B027  (optional hook)
        """The request with ``key`` was sent to ``worker``."""

    def forget(self, url: str) -> None:  # noqa: B027  (optional hook)
        """``url`` left the cluster."""


def least_loaded(candidates: list[Worker], rng: random.Random) -> Worker:
    low = min(w.load for w in candidates)
    return rng.choice([w for w in candidates if w.load == low])  # ties at random: no herd on the first


class LeastLoaded(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], key: str | None) -> Worker:
        return least_loaded(candidates, self._rng)


class PowerOfTwo(Policy):
    """Two at random, the less loaded of them: near least-loaded balance from stale loads."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], key: str | None) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if a.load <= b.load else b


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = itertools.count()

    def pick(self, candidates: list[Worker], key: str | None) -> Worker:
        ordered = sorted(candidates, key=lambda w: w.url)  # stable order while the set changes
        return ordered[next(self._next) % len(ordered)]


class Random(Policy):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], key: str | None) -> Worker:
        return self._rng.choice(candidates)


class CacheAware(Policy):
    """Without a tokenizer (the character tree): requests sharing a prompt prefix go to the worker that saw it (its radix cache holds it),
    unless that worker has more than ``balance_abs_threshold`` requests above the least loaded
    one; prompts no worker has seen enough of (share < ``threshold``) go to the least loaded."""

    def __init__(self, cfg: CacheAwareConfig, rng: random.Random | None = None) -> None:
        self._cfg = cfg
        self._tree = PrefixTree(cfg.max_tree_chars)
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], key: str | RouteKey | None) -> Worker:
        fallback = least_loaded(candidates, self._rng)
        if isinstance(key, RouteKey):
            key = key.text
        if not key:
            return fallback
        matched = self._tree.match(key)
        owners = [w for w in candidates if matched.get(w.url, 0) > 0]
        if not owners:
            return fallback
        best = max(owners, key=lambda w: (matched[w.url], -w.load))
        if matched[best.url] / len(key) < self._cfg.threshold:
            return fallback
        if best.load - fallback.load > self._cfg.balance_abs_threshold:
            return fallback
        return best

    def on_routed(self, worker: Worker, key: str | RouteKey | None) -> None:
        if isinstance(key, RouteKey):
            key = key.text
        if key:
            self._tree.insert(key, worker.url)

    def forget(self, url: str) -> None:
        self._tree.remove_worker(url)


class ExactCacheAware(Policy):
    """With a tokenizer and the nodes' KV events (router/kv_index.py): the prefill that must compute
    the fewest tokens for this prompt, counting what it has queued.

    Among the candidates whose load is within ``balance_abs_threshold`` requests of the least
    loaded one, pick the minimum of ``(prompt tokens - predicted cached tokens) + queued tokens``
    (queued: the uncached tokens of this router's requests the worker has not computed yet: until
    a stream's decode answers, else until the prefill does; router/forward.py), ties
    by load, then by a hash of (worker URL, the prompt's first block): rendezvous hashing, so cold
    prompts spread over idle workers instead of herding on one, and a prompt's later turns find
    the same order. No randomness: two routers with the same index and the same loads choose
    alike. A request without token ids, or a candidate whose index is not in sync (its
    subscription is starting, lost or resyncing), is routed by load alone (least loaded, ties by
    URL): a prediction from a stale index would be a guess.
    """

    role = "prefill"

    def __init__(self, cfg: CacheAwareConfig, index: KVIndex) -> None:
        self._cfg = cfg
        self._index = index
        self.picks: Counter[str] = Counter()  # by mode: exact, no_tokens, unsynced (a metric)

    def cost(self, w: Worker, prompt_tokens: int, hit: int) -> int:
        """What choosing ``w`` costs (lower wins): the tokens it must compute, its queue included."""
        return prompt_tokens - hit + w.queued_tokens

    def pick(self, candidates: list[Worker], key: str | RouteKey | None) -> Worker:
        by_load = min(candidates, key=lambda w: (w.load, w.url))
        if isinstance(key, RouteKey):
            key.predictions(self.role).clear()  # a retry's pick: only this one's predictions count
        if not isinstance(key, RouteKey) or key.tokens is None:
            self.picks["no_tokens"] += 1
            return by_load
        indexes = [self._index.synced(w.url) for w in candidates]
        if any(idx is None for idx in indexes):
            self.picks["unsynced"] += 1
            return by_load
        n = len(key.tokens)
        predicted = key.predictions(self.role)
        best: tuple[int, int, int, str] | None = None
        choice = by_load
        for w, idx in zip(candidates, indexes):
            assert idx is not None
            if w.load - by_load.load > self._cfg.balance_abs_threshold:
                continue
            hit = idx.matched_blocks(key.hashes(idx.block_size)) * idx.block_size
            predicted[w.url] = hit
            rank = (self.cost(w, n, hit), w.load, rendezvous(w.url, key.salt()), w.url)
            if best is None or rank < best:
                best, choice = rank, w
        self.picks["exact"] += 1
        return choice


class ExactDecodeCacheAware(ExactCacheAware):
    """The decode side of exact routing: the decode whose prefix cache (its KV events) holds the
    longest prefix of the prompt, so the prefill sends it only the rest (``decode_prefix_len``).

    The same load bound, tie-breaks and fallbacks as the prefill's pick; the cost is only the
    hit (a decode computes no prompt tokens: what it holds is what is not sent). The predicted
    hit is what the decode reuses: it matches the prompt as the prefill does, whole pages with
    the last token always sent (``RouteKey.hashes``).
    """

    role = "decode"

    def cost(self, w: Worker, prompt_tokens: int, hit: int) -> int:
        return -hit


def rendezvous(url: str, salt: int) -> int:
    """A worker's deterministic, per-prompt tie-break rank (the same in every router)."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8, key=salt.to_bytes(8, "little")).digest(), "little")


def make_policy(name: str, cache: CacheAwareConfig, index: KVIndex | None = None, role: str = "prefill") -> Policy:
    """``index``: the nodes' KV events, for exact cache-aware routing of ``role``'s pick."""
    if name == "least-loaded":
        return LeastLoaded()
    if name == "power-of-two":
        return PowerOfTwo()
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "cache-aware":
        if index is None:
            return CacheAware(cache)
        return ExactCacheAware(cache, index) if role == "prefill" else ExactDecodeCacheAware(cache, index)
    raise ValueError(f"unknown policy {name!r}")
