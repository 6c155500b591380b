"""What the decode scheduler tells the ops endpoints (``common.ipc.node_io.NodeStats``).

``/debug/memory`` is the leak detector used by every e2e scenario: once a node is idle, its free
pages, request rows and aux slots must equal the totals again and ``integrity`` must be "ok".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from common.ipc.node_io import RateMeter
from common.node.kv_events import snapshot_reply
from decode_node.scheduler import DecodeScheduler

if TYPE_CHECKING:
    from common.kvcache.kv_event_log import KVEventLog


class DecodeStats:
    def __init__(self, sched: DecodeScheduler, aux_total_slots: int, transfer_rooms: Callable[[], int] | None = None,
                 page_nbytes: int = 0, kv_events: KVEventLog | None = None) -> None:
        """``page_nbytes``: bytes of one KV page of this rank (every layer, K and V), what one
        transferred page moved over the wire to it. ``kv_events``: the prefix cache's event log
        (rank 0 with the cache on), flushed after every loop turn."""
        self.sched = sched
        self.page_nbytes = page_nbytes
        self.aux_total_slots = aux_total_slots
        self._transfer_rooms = transfer_rooms
        self.throughput = RateMeter()
        self._seen_tokens = self._seen_steps = 0
        self._events = kv_events

    def observe_step(self, turn_s: float) -> None:
        """After each loop turn (``common.node.contract``): feeds the throughput window, and a turn
        that ran a decode step adds to ``decode_step_seconds`` (the whole turn: input, queues,
        forward, stop checks, output IPC; minus the forward it is the per-step overhead), and
        publishes the turn's KV events (one batch, non-blocking)."""
        c = self.sched.counters
        self.throughput.add(c.generated_tokens - self._seen_tokens)
        self._seen_tokens = c.generated_tokens
        if c.decode_steps != self._seen_steps:
            self._seen_steps = c.decode_steps
            c.decode_step_seconds += turn_s
        if self._events is not None:
            self._events.flush()

    def kv_snapshot(self) -> dict:
        """Every block the prefix cache holds and the event ``seq`` that includes them (GET /kv_events/snapshot)."""
        return snapshot_reply(self._events)

    def queued(self) -> int:
        return self.sched.queues.num_queued()

    def load(self) -> dict[str, int]:
        s = self.sched
        mem = s.memory
        used_pages = mem.allocator.num_total - mem.available_pages()  # unlocked cached pages are free capacity
        return {"num_reqs": len(s.queues.running) + self.queued(), "num_waiting_reqs": self.queued(),
                "num_tokens": used_pages * mem.page_size}

    def memory(self) -> dict:
        s, q = self.sched, self.sched.queues
        out: dict = dict(s.memory.stats())
        out.update({
            "aux_total_slots": self.aux_total_slots,
            "aux_free_slots": s.aux.num_free(),
            "num_prealloc": len(q.prealloc), "num_transfer": len(q.transfer), "num_waiting": len(q.waiting),
            "num_running": len(q.running), "num_retracted": len(q.retracted), "num_draining": len(q.draining),
            **self._fenced(),
            "new_token_ratio": round(s.ratio.value, 4),
        })
        if self._transfer_rooms is not None:
            out["transfer_rooms"] = self._transfer_rooms()
        try:
            s.memory.check_integrity()
            s.aux.check_integrity()
            out["integrity"] = "ok"
        except Exception as exc:  # reported, not raised: this endpoint exists to show such faults
            out["integrity"] = f"{type(exc).__name__}: {exc}"
        return out

    def metrics(self) -> dict[str, float]:
        s, q = self.sched, self.sched.queues
        alloc = s.memory.allocator
        return {
            "num_running_reqs": len(q.running),
            "num_waiting_reqs": len(q.waiting) + len(q.prealloc) + len(q.retracted),
            "num_transfer_reqs": len(q.transfer),
            "num_prealloc_reqs": len(q.prealloc),
            "num_retracted_reqs": len(q.retracted),
            "fenced_reqs": self._fenced()["fenced_reqs"],
            "token_usage": (alloc.num_total - s.memory.available_pages()) / max(alloc.num_total, 1),
            "gen_throughput": self.throughput.rate(),
            "new_token_ratio": s.ratio.value,
            **{f"{k}_total": float(v) for k, v in asdict(s.counters).items()
               if k not in ("transferred_tokens", "reused_tokens", "transferred_pages", "local_prefill_tokens")},
            # Role-named counters (common.server.metrics writes a "pdc_" key as it is).
            "pdc_decode_transferred_tokens_total": float(s.counters.transferred_tokens),
            "pdc_decode_reused_tokens_total": float(s.counters.reused_tokens),
            "pdc_decode_local_prefill_tokens_total": float(s.counters.local_prefill_tokens),
            "pdc_decode_transferred_bytes_total": float(s.counters.transferred_pages * self.page_nbytes),
            "kv_integrity_failures_total": float(s.memory.digests.failures if s.memory.digests is not None else 0),
            **self._steps(),
            **(s.grammars.metrics() if s.grammars is not None else {}),
        } | ({} if self._events is None else self._events.metrics())

    def _steps(self) -> dict[str, float]:
        """Decode steps that ran as one call of the whole-step CPU kernel (common/models/
        native_decode.py), beside ``decode_steps_total``; absent where the engine is not a runner's."""
        runner = getattr(self.sched.engine, "runner", None)
        return {} if runner is None else {"pdc_decode_native_steps_total": float(runner.native_decode_steps)}

    def _fenced(self) -> dict[str, int]:
        """Failed rooms whose memory stays held while their prefill may still write (never free,
        never a leak; see transfer.fenced)."""
        held = [r for r in self.sched.queues.draining if r.receiver is not None and r.receiver.fenced()]
        return {"fenced_reqs": len(held), "fenced_pages": sum(len(r.kv.pages) for r in held if r.kv is not None)}

    def flush_cache(self) -> tuple[bool, str]:
        """Drop the decode's prefix cache (empty unless --disaggregation-decode-enable-radix-cache);
        refused while requests are in flight (as SGLang does)."""
        if not self.sched.idle():
            return False, "requests are in flight; retry when the node is idle"
        cache = self.sched.memory.cache
        if not cache.enabled:
            return True, "decode node holds no prefix cache; nothing to flush"
        pages = cache.total_pages()
        if not cache.reset():  # idle: no request holds a lock
            return False, "the prefix cache is locked; retry when the node is idle"
        return True, f"flushed the decode's prefix cache ({pages} pages)"
