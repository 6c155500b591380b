"""The router's per-worker index of cached blocks, fed by the nodes' KV events (common/kv_events.py).

One ``WorkerIndex`` per subscribed node (prefills, and decodes when the decode pick is exact):
the set of block hashes its radix cache holds, the publisher instance and the ``seq`` of the
last batch applied. Plain data in, a verdict out: the
subscriber (router/kv_subscriber.py) does the I/O and acts on the verdict::

    unsynced --load(snapshot)--> synced --apply(batch seq = last + 1)--> synced
        ^                          |  heartbeat (no events, seq = last)     ok
        |                          |  seq <= last with events               "replayed": dropped
        +------- resync -----------+  seq > last + 1 (a batch was lost)     "gap": resync
                                      another instance_id (restart)         "restarted": cleared, resync
                                      another block size                    "malformed": dropped

Batches that arrive while the snapshot is being fetched wait in ``pending`` and are applied
after it (those the snapshot already includes are skipped), so nothing between subscribing and
the snapshot is lost. A worker whose index is not synced predicts nothing (``matched`` is None);
the policy then routes by load (router/policies.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.kv_events import AllCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

MAX_PENDING = 1024  # batches held while a snapshot is fetched; more: start that sync again


@dataclass
class WorkerIndex:
    url: str
    blocks: set[int] = field(default_factory=set)
    instance_id: str | None = None
    seq: int = 0
    block_size: int = 0
    synced: bool = False
    pending: list[KVEventBatch] = field(default_factory=list)  # while unsynced

    def clear(self) -> None:
        """Forget everything (a worker that restarted or left rotation)."""
        self.blocks = set()
        self.instance_id, self.seq, self.block_size, self.synced = None, 0, 0, False
        self.pending = []

    def load(self, snap: KVSnapshot) -> list[str]:
        """Start from ``snap``, then apply the batches that waited for it. The verdicts of those."""
        self.blocks = set(snap.blocks)
        self.instance_id, self.seq, self.block_size, self.synced = snap.instance_id, snap.seq, snap.block_size, True
        waiting, self.pending = self.pending, []
        verdicts = []
        for batch in waiting:
            if batch.instance_id == snap.instance_id and batch.seq <= snap.seq:
                continue  # already in the snapshot
            verdicts.append(self.apply(batch))
            if not self.synced:
                break
        return verdicts

    def apply(self, batch: KVEventBatch) -> str:
        """Apply one batch. Verdicts: "applied", "heartbeat", "buffered" (waiting for a snapshot),
        "replayed" (dropped), "malformed" (dropped), "gap" and "restarted" (now unsynced: resync)."""
        if not self.synced:
            if len(self.pending) >= MAX_PENDING:
                self.pending = []
                return "gap"
            self.pending.append(batch)
            return "buffered"
        if batch.instance_id != self.instance_id:
            self.clear()
            return "restarted"
        if batch.block_size != self.block_size:
            return "malformed"
        if not batch.events:
            if batch.seq == self.seq:
                return "heartbeat"
            if batch.seq < self.seq:
                return "replayed"
            self.synced = False  # the heartbeat says we missed batches
            return "gap"
        if batch.seq <= self.seq:
            return "replayed"
        if batch.seq != self.seq + 1:
            self.synced = False
            return "gap"
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.blocks.difference_update(ev.block_hashes)
            elif isinstance(ev, AllCleared):
                self.blocks.clear()
        self.seq = batch.seq
        return "applied"

    def matched_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) this worker holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


class KVIndex:
    """Every subscribed worker's ``WorkerIndex``, by URL (URLs are unique across roles)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerIndex] = {}

    def get(self, url: str) -> WorkerIndex:
        idx = self.workers.get(url)
        if idx is None:
            idx = self.workers[url] = WorkerIndex(url)
        return idx

    def synced(self, url: str) -> WorkerIndex | None:
        idx = self.workers.get(url)
        return idx if idx is not None and idx.synced else None

    def block_sizes(self) -> tuple[int, ...]:
        """The synced workers' block sizes (one, in a cluster of equal page sizes)."""
        return tuple({idx.block_size for idx in self.workers.values() if idx.synced})

    def forget(self, url: str) -> None:
        idx = self.workers.pop(url, None)
        if idx is not None:
            idx.clear()
