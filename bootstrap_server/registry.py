"""The routing table itself: plain data behind a lock, no HTTP (the server is a thin shell over it).

A lock, not the event loop, guards it because the embedding prefill process may also touch it
from its own threads (e.g. to register its ranks without a loopback HTTP round trip).
"""
from __future__ import annotations

import logging
import threading

from bootstrap_server.schema import LAYOUT_FIELDS, PrefillLayout, RankInfo, RankKey

logger = logging.getLogger(__name__)


class RegistryConflict(ValueError):
    """A registration or deregistration that contradicts what is already registered."""


def format_key(key: RankKey) -> str:
    dp_group, engine_rank, pp_rank = key
    return f"(dp_group={dp_group}, engine_rank={engine_rank}, pp_rank={pp_rank})"


class Registry:
    """Prefill ranks of one node, keyed by ``(dp_group, engine_rank, pp_rank)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[RankKey, RankInfo] = {}

    def register(self, info: RankInfo) -> RankInfo | None:
        """Add or replace ``info``'s rank; return the entry it replaced (a restarted rank), if any.

        Raises ``RegistryConflict`` when its node layout differs from another registered rank's,
        or when another rank already claims the same ZMQ endpoint. The rank's own previous entry
        is not compared against: a restarted rank may come back with a new layout.
        """
        with self._lock:
            for key, other in self._ranks.items():
                if key == info.key:
                    continue
                diffs = [f for f in LAYOUT_FIELDS if getattr(info, f) != getattr(other, f)]
                if diffs:
                    detail = ", ".join(f"{f} {getattr(info, f)!r} != {getattr(other, f)!r}" for f in diffs)
                    raise RegistryConflict(
                        f"layout mismatch: rank {format_key(info.key)} differs from registered rank "
                        f"{format_key(key)}: {detail}"
                    )
                if (other.rank_ip, other.rank_port) == (info.rank_ip, info.rank_port):
                    raise RegistryConflict(
                        f"rank {format_key(info.key)}: endpoint {info.rank_ip}:{info.rank_port} is already "
                        f"registered by rank {format_key(key)}"
                    )
            old = self._ranks.get(info.key)
            self._ranks[info.key] = info
        if old is None:
            logger.info("registered prefill rank %s at %s", format_key(info.key), info.endpoint)
        else:
            logger.info("re-registered prefill rank %s at %s (was %s)", format_key(info.key), info.endpoint, old.endpoint)
        return old

    def lookup(self, dp_group: int, engine_rank: int, pp_rank: int = 0) -> RankInfo | None:
        with self._lock:
            return self._ranks.get((dp_group, engine_rank, pp_rank))

    def layout(self) -> PrefillLayout | None:
        """The node layout, or ``None`` while no rank has registered."""
        with self._lock:
            if not self._ranks:
                return None
            # Every entry agrees on LAYOUT_FIELDS (register enforces it), so any one will do.
            return PrefillLayout.of(next(iter(self._ranks.values())), registered_ranks=len(self._ranks))

    def deregister(self, dp_group: int, engine_rank: int, pp_rank: int = 0, instance_id: str | None = None) -> RankInfo | None:
        """Remove a rank; return the removed entry, or ``None`` when it was not registered.

        With ``instance_id``, only that incarnation is removed: a late shutdown of a dead process
        must not remove the entry its restarted successor just wrote (``RegistryConflict``).
        """
        key = (dp_group, engine_rank, pp_rank)
        with self._lock:
            current = self._ranks.get(key)
            if current is None:
                return None
            if instance_id is not None and current.instance_id != instance_id:
                raise RegistryConflict(
                    f"rank {format_key(key)} is registered by instance {current.instance_id!r}, not {instance_id!r}"
                )
            del self._ranks[key]
        logger.info("deregistered prefill rank %s", format_key(key))
        return current

    def clear(self) -> int:
        """Remove every rank (whole-node shutdown); return how many were registered."""
        with self._lock:
            count = len(self._ranks)
            self._ranks.clear()
        if count:
            logger.info("deregistered all %d prefill rank(s)", count)
        return count

    def ranks(self) -> list[RankInfo]:
        """Every registered rank, ordered by key."""
        with self._lock:
            return [self._ranks[k] for k in sorted(self._ranks)]
