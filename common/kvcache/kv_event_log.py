"""The radix cache's KV events, recorded as the cache changes and published once per scheduler
step on a ZMQ PUB socket (the format and its rules: ``common/kv_events.py``, docs/PROTOCOL.md §7).

::

    RadixCache.insert / evict / discard_after / reset      (scheduler thread, inside a step)
        -> KVEventLog.stored / removed / cleared             page ids -> chained block hashes,
                                                             appended to this step's list
    node loop, after each turn (stats.observe_step)
        -> KVEventLog.flush                                  one batch, seq + 1, non-blocking send
    GET /kv_events/snapshot (a query answered between steps)
        -> KVEventLog.snapshot                               flushes first, so its seq is exact
    the publisher's heartbeat thread, every HEARTBEAT_S / 2
        -> KVEventLog.heartbeat_if_due                       an empty batch with the last seq when
                                                             nothing went out for HEARTBEAT_S

Why a thread beats for the loop: a step can be long (a 2048-token prefill on one CPU core takes
seconds; so can a large chunked prefill on a device), and a subscriber that hears nothing for its
bound stops trusting the index and routes that node by load, losing every cache hit until it has
resynced. Silence must mean the node is gone, not busy. A heartbeat claims only "nothing after
seq N", which stays true while a step runs: that step's events go out at its end, as seq N + 1.
One lock makes the seq's increment and its send one act for both threads, and serialises the
socket (a ZMQ socket must not be used by two threads at once).

Why per page id: a page on a tree edge holds exactly one block, and pages are unique on the tree,
so ``page -> hash`` is all the state needed to name what an eviction frees; splits and merges of
edges change nothing. A stored block's hash chains from its parent page's hash.

Never slows the loop: one hash per new cached page, one dict operation per freed one, and one
msgpack encode plus a ``NOBLOCK`` send per step that changed the cache (PUB drops for a
subscriber that does not keep up; it sees the ``seq`` gap and resyncs from the snapshot). The
events of one step are bounded (``max_pending_blocks``): past it they are dropped and the next
batch skips a ``seq``, which every subscriber reads as a gap.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from common.kv_events import (
    HEARTBEAT_S,
    ROOT_HASH,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventCodec,
    KVEvent,
    KVEventBatch,
    KVEventsInfo,
    KVSnapshot,
    block_hashes,
)

log = logging.getLogger(__name__)

_SNDHWM = 10_000  # batches queued per subscriber before PUB drops for it


@dataclass
class KVEventCounters:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    batches: int = 0  # sent with events (heartbeats not counted)
    heartbeats: int = 0
    send_errors: int = 0  # a send that raised (never blocks: PUB drops silently for slow subscribers)
    overflows: int = 0  # steps whose events were dropped (over max_pending_blocks); seq skipped
    snapshots: int = 0


class KVEventLog:
    """What the cache holds, as block hashes, and this step's events. The scheduler loop owns it
    (as it owns the cache); only ``heartbeat_if_due`` may be called from another thread."""

    def __init__(self, role: str, block_size: int, codec: EventCodec, sock: zmq.Socket | None = None,
                 max_pending_blocks: int = 1 << 20, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.role = role
        self.block_size = block_size
        self.instance_id = uuid.uuid4().hex
        self.counters = KVEventCounters()
        self._codec = codec
        self._sock = sock
        self._max = max_pending_blocks
        self._clock = clock
        self._hash: dict[int, int] = {}  # cached page -> its block hash
        self._pending: list[KVEvent] = []
        self._pending_blocks = 0
        self._overflow = False
        self.seq = 0  # of the last batch published (0: none yet)
        self._last_send = clock()
        self._send_lock = threading.Lock()  # seq + its send, and the socket (module docstring)

    # -- the radix cache's hooks ----------------------------------------------------------------

    # The hooks run inside the cache's own updates: they must never raise into them (a half-done
    # release would leak a lock). What they cannot name (a parent page they never saw: a bug) is
    # left out of the log and the subscribers are sent to the snapshot; the cache is unaffected.

    def stored(self, parent_page: int | None, pages: Sequence[int], token_ids: Sequence[int]) -> None:
        """``pages`` (holding ``token_ids``, whole blocks) entered the cache after ``parent_page``."""
        parent = ROOT_HASH if parent_page is None else self._hash.get(parent_page)
        if parent is None:
            log.error("KV events: page %d is cached after page %d, which has no hash; not published",
                      pages[0] if pages else -1, parent_page)
            self._overflow = True
            return
        hashes = block_hashes(token_ids, self.block_size, parent)
        for page, h in zip(pages, hashes):
            self._hash[page] = h
        self.counters.stored_blocks += len(hashes)
        self._add(BlockStored(parent_hash=None if parent_page is None else parent, block_hashes=hashes), len(hashes))

    def removed(self, pages: Sequence[int]) -> None:
        hashes = [h for h in (self._hash.pop(p, None) for p in pages) if h is not None]
        self.counters.removed_blocks += len(hashes)
        self._add(BlockRemoved(block_hashes=hashes), len(hashes))

    def cleared(self) -> None:
        self._hash.clear()
        self.counters.cleared += 1
        # Whatever this step did before is moot: the subscriber ends up empty either way.
        self._pending, self._pending_blocks, self._overflow = [], 0, False
        self._add(AllCleared(), 0)

    def _add(self, event: KVEvent, blocks: int) -> None:
        if self._overflow:
            return
        if self._pending_blocks + blocks > self._max:
            self._overflow = True
            self._pending, self._pending_blocks = [], 0
            return
        self._pending.append(event)
        self._pending_blocks += blocks

    # -- publishing --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Once per loop turn: this step's events as one batch (heartbeats are the publisher
        thread's: ``heartbeat_if_due``)."""
        with self._send_lock:
            if self._overflow:
                # Skip a number: every subscriber sees a gap and starts again from the snapshot.
                self.counters.overflows += 1
                log.warning("KV events: one step changed more than %d blocks; subscribers will resync", self._max)
                self.seq += 1
                self._overflow = False
            if self._pending:
                self.seq += 1
                events, self._pending, self._pending_blocks = self._pending, [], 0
                self._send(events)
                self.counters.batches += 1

    def heartbeat_if_due(self) -> None:
        """An empty batch carrying the last ``seq``, when nothing went out for ``HEARTBEAT_S``.
        Safe from any thread (the publisher's heartbeat thread calls it while a step runs)."""
        with self._send_lock:
            if self._clock() - self._last_send >= HEARTBEAT_S:
                self._send([])
                self.counters.heartbeats += 1

    def _send(self, events: list[KVEvent]) -> None:
        """Under ``_send_lock``."""
        self._last_send = self._clock()
        if self._sock is None:
            return
        batch = KVEventBatch(instance_id=self.instance_id, seq=self.seq, block_size=self.block_size,
                             role=self.role, ts=time.time(), events=events)  # type: ignore[arg-type]
        try:
            self._sock.send(self._codec.encode(batch), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.counters.send_errors += 1
            log.debug("KV events: send failed: %s", exc)

    def snapshot(self) -> KVSnapshot:
        """Every block held now, and the ``seq`` that includes them (pending events go out first)."""
        if self._pending or self._overflow:
            self.flush()
        self.counters.snapshots += 1
        return KVSnapshot(instance_id=self.instance_id, seq=self.seq, block_size=self.block_size,
                          role=self.role, blocks=list(self._hash.values()))  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {"kv_events_stored_blocks_total": float(c.stored_blocks),
                "kv_events_removed_blocks_total": float(c.removed_blocks),
                "kv_events_cleared_total": float(c.cleared),
                "kv_events_batches_total": float(c.batches),
                "kv_events_send_errors_total": float(c.send_errors),
                "kv_events_overflows_total": float(c.overflows),
                "kv_events_seq": float(self.seq),
                "kv_events_blocks": float(len(self._hash))}


class KVEventPublisher:
    """The PUB socket a ``KVEventLog`` sends on, bound to the node's advertised host."""

    def __init__(self, role: str, block_size: int, host: str, port: int, secret: str | None) -> None:
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.PUB)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            if port:
                self._sock.bind(f"tcp://{_bracket(host)}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.host = host
        codec = EventCodec(secret)
        self.log = KVEventLog(role, block_size, codec, self._sock)
        self.info = KVEventsInfo(endpoint=f"tcp://{_bracket(host)}:{self.port}", host=host, port=self.port,
                                 instance_id=self.log.instance_id, block_size=block_size, sealed=codec.sealed)
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, name="kv-events-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        """Heartbeats while the scheduler is inside a long step (module docstring)."""
        while not self._stop.wait(HEARTBEAT_S / 2):
            self.log.heartbeat_if_due()

    def close(self) -> None:
        self._stop.set()
        self._beats.join(timeout=5.0)
        self._sock.close(linger=0)
        self._ctx.term()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
