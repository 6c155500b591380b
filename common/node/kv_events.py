"""A node's KV-event publisher, wired the same way for both roles (docs/PROTOCOL.md §7).

::

    part.build_scheduler:  start_publisher(cfg, role, runner, host, secret)
                             rank 0 only, its prefix cache on, before the first insert:
                             a PUB socket (common/kvcache/kv_event_log.py) the cache reports to
    part.ready_info:       publisher_info(pub) -> /server_info's "kv_events"
    stats.observe_step:    log.flush()            one batch per loop turn that changed the cache
    GET /kv_events/snapshot -> stats.kv_snapshot -> snapshot_reply(log)
    part.close:            pub.close()

Rank 0 alone publishes: every rank's cache holds the same blocks (same steps, same inputs). The
log must be attached before the first insert: it names a cached page by the hash it recorded.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from common.config import KVEventsConfig

if TYPE_CHECKING:
    from common.engine.model_runner import ModelRunner
    from common.kvcache.kv_event_log import KVEventLog, KVEventPublisher


def start_publisher(cfg: KVEventsConfig, role: str, runner: ModelRunner, host: str,
                    secret: str | None) -> KVEventPublisher | None:
    """The publisher ``runner``'s prefix cache reports to, or None where this rank publishes
    nothing (events off, no prefix cache, not TP rank 0)."""
    cache = runner.memory.cache
    if not (cfg.enabled and cache.enabled and runner.tp.is_first):
        return None
    from common.kvcache.kv_event_log import KVEventPublisher

    pub = KVEventPublisher(role, cache.page_size, host, cfg.port, secret)
    cache.events = pub.log
    return pub


def publisher_info(pub: KVEventPublisher | None) -> dict:
    """What the role adds to its "ready" report (and so to ``/server_info``): where to subscribe."""
    return {} if pub is None else {"kv_events": msgspec.to_builtins(pub.info)}


def snapshot_reply(log: KVEventLog | None) -> dict:
    """``GET /kv_events/snapshot``'s answer: every block the cache holds and the ``seq`` that
    includes them, or why there is none."""
    if log is None:
        return {"error": "this node publishes no KV events (--disable-kv-events or no prefix cache)"}
    return msgspec.to_builtins(log.snapshot())
