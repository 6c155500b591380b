"""What the prefill scheduler shows the ops endpoints (``common.ipc.node_io.NodeStats``).

Read between two steps by ``NodeIO.recv``, so every number describes one consistent state.
Idle baseline of ``/debug/memory`` (what a leak test compares against): every queue empty,
``held_pages == 0``, ``free_req_slots == total_req_slots``, ``transfer_rooms == 0``, and
``free_pages + cached_pages == total_pages``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from common.ipc.node_io import RateMeter
from common.node.kv_events import snapshot_reply
from prefill_node.scheduler import PrefillScheduler

if TYPE_CHECKING:
    from common.kvcache.kv_event_log import KVEventLog


class PrefillStats:
    def __init__(self, sched: PrefillScheduler, transfer_rooms: Callable[[], int] | None = None,
                 kv_events: KVEventLog | None = None) -> None:
        self._s = sched
        self._rooms = transfer_rooms or (lambda: 0)
        self._meter = RateMeter()
        self._seen_tokens = 0
        self._events = kv_events

    def observe_step(self, turn_s: float) -> None:
        """After each loop turn (``common.node.contract``): feeds the prefill throughput window and
        publishes the turn's KV events (one batch, non-blocking)."""
        done = self._s.counters.prompt_tokens
        self._meter.add(done - self._seen_tokens)
        self._seen_tokens = done
        if self._events is not None:
            self._events.flush()

    def kv_snapshot(self) -> dict:
        """Every block the prefix cache holds and the event ``seq`` that includes them (GET /kv_events/snapshot)."""
        return snapshot_reply(self._events)

    def _held_pages(self, inflight_only: bool = False) -> int:
        """Pages the requests own. Their cached prefix pages are the cache's (counted in
        ``cached_pages``, locked): counting them here too made the parts exceed the total."""
        s, q = self._s, self._s.queues
        reqs = q.inflight if inflight_only else list(q.reqs.values())
        ps = s.memory.page_size
        return sum(len(r.kv.pages) - r.kv.num_cached // ps for r in reqs if r.kv is not None)

    def load(self) -> dict[str, int]:
        s, q = self._s, self._s.queues
        return {
            "num_reqs": len(q.reqs),
            "num_waiting_reqs": len(q.bootstrap) + len(q.waiting),
            "num_tokens": self._held_pages() * s.memory.page_size,
        }

    def memory(self) -> dict:
        s, q = self._s, self._s.queues
        return {
            **s.memory.stats(),
            "held_pages": self._held_pages(),  # pages owned by live requests (not the cache)
            "transfer_pages": self._held_pages(inflight_only=True),  # ... of which a transfer may read
            "bootstrap_reqs": len(q.bootstrap),
            "waiting_reqs": len(q.waiting),
            "chunked_reqs": int(q.chunked is not None),
            "parked_reqs": len(q.parked),  # computed ahead; their decode has not answered yet
            "inflight_reqs": len(q.inflight),
            "live_reqs": len(q.reqs),
            "transfer_rooms": self._rooms(),
        }

    def metrics(self) -> dict[str, float]:
        s, q, c = self._s, self._s.queues, self._s.counters
        mem = s.memory
        total = mem.allocator.num_total
        return {
            "num_running_reqs": float(len(q.inflight) + len(q.parked) + (q.chunked is not None)),
            "num_waiting_reqs": float(len(q.bootstrap) + len(q.waiting)),
            "num_bootstrap_reqs": float(len(q.bootstrap)),
            "num_transfer_reqs": float(len(q.inflight)),
            "token_usage": 1.0 - mem.available_pages() / total if total else 0.0,
            "gen_throughput": self._meter.rate(),  # prompt tokens computed per second
            "finished_reqs_total": float(c.finished),
            "failed_reqs_total": float(c.failed),
            "aborted_reqs_total": float(c.aborted),
            "rejected_reqs_total": float(c.rejected),
            "prompt_tokens_total": float(c.prompt_tokens),
            "cached_tokens_total": float(c.cached_tokens),
            "forward_seconds_total": c.forward_s,
            "forwards_total": float(c.forwards),
            "kv_integrity_failures_total": float(mem.digests.failures if mem.digests is not None else 0),
            **(s.grammars.metrics() if s.grammars is not None else {}),
        } | ({} if self._events is None else self._events.metrics())

    def flush_cache(self) -> tuple[bool, str]:
        s = self._s
        if s.queues.reqs:
            return False, f"{len(s.queues.reqs)} requests are in flight; flush when the node is idle"
        if not s.memory.cache.reset():
            return False, "the prefix cache is locked"
        return True, "prefix cache flushed"
