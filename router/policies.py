"""Which worker gets a request: one policy for the prefill role and one for the decode role.

Contract (``Policy.pick``): given the candidates — healthy, not draining, at least one — and
the request's prompt key (text the cache-aware policy matches prefixes on; None when there is
none), return one of them. ``on_routed`` is told where a request went; ``forget`` that a worker
left. A policy never blocks and never does I/O: loads are what ``Worker.load`` says now.
"""
from __future__ import annotations

import abc
import itertools
import random

from router.config import CacheAwareConfig
from router.prefix_tree import PrefixTree
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
    """Requests sharing a prompt prefix go to the worker that saw it (its radix cache holds it),
    unless that worker has more than ``balance_abs_threshold`` requests above the least loaded
    one; prompts no worker has seen enough of (share < ``threshold``) go to the least loaded."""

    def __init__(self, cfg: CacheAwareConfig, rng: random.Random | None = None) -> None:
        self._cfg = cfg
        self._tree = PrefixTree(cfg.max_tree_chars)
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], key: str | None) -> Worker:
        fallback = least_loaded(candidates, self._rng)
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

    def on_routed(self, worker: Worker, key: str | None) -> None:
        if key:
            self._tree.insert(key, worker.url)

    def forget(self, url: str) -> None:
        self._tree.remove_worker(url)


def make_policy(name: str, cache: CacheAwareConfig) -> Policy:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "power-of-two":
        return PowerOfTwo()
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    if name == "cache-aware":
        return CacheAware(cache)
    raise ValueError(f"unknown policy {name!r}")
