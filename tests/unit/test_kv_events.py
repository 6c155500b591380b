"""KV events, node side and wire: chained block hashes, the sealed codec, and the radix cache's
events mirrored into a router index (router/kv_index.py) that must predict every match exactly,
through inserts, LRU evictions, dropped branches, resets, lost batches and overflowing steps."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from common.kv_events import (
    HEARTBEAT_S,
    ROOT_HASH,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventCodec,
    KVEventBatch,
    Malformed,
    block_hashes,
    decode_snapshot,
)
from common.kvcache.allocator import PageAllocator
from common.kvcache.kv_event_log import KVEventLog, KVEventPublisher
from common.kvcache.radix_cache import RadixCache
from router.kv_index import WorkerIndex

SECRET = "kv-events-test-secret-0123456789"


# ---- block hashes --------------------------------------------------------------------------------


def test_block_hashes_chain_and_name_their_whole_prefix() -> None:
    a, b = list(range(8)), [100, 101, 102, 103, 104]
    hs = block_hashes(a + b, 4)
    assert len(hs) == 3  # the partial last block (104) has no hash
    assert hs == block_hashes(a, 4) + block_hashes(b, 4, parent=hs[1])  # continuing from a parent
    assert block_hashes(a, 4)[0] == block_hashes(a[:4] + [9, 9, 9, 9], 4)[0]  # same first block
    # The same block after a different prefix has a different name.
    assert block_hashes([7, 7, 7, 7] + a[4:8], 4)[1] != hs[1]
    assert block_hashes([1, 2, 3], 4) == []
    assert all(0 <= h < 1 << 64 for h in hs) and ROOT_HASH not in hs
    with pytest.raises(OverflowError):
        block_hashes([1 << 32, 0, 0, 0], 4)


def test_block_hashes_are_the_same_in_every_process() -> None:
    """No salted hash(): another interpreter with another hash seed gets the same names."""
    code = "from common.kv_events import block_hashes; print(block_hashes(list(range(40)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(block_hashes(list(range(40)), 16))


# ---- the codec -----------------------------------------------------------------------------------


def _batch(seq: int, events: list, instance: str = "i1", block_size: int = 4) -> KVEventBatch:
    return KVEventBatch(instance_id=instance, seq=seq, block_size=block_size, role="prefill", ts=0.0, events=events)


def test_codec_round_trips_and_refuses_what_it_cannot_trust() -> None:
    batch = _batch(3, [BlockStored(parent_hash=None, block_hashes=[1, (1 << 64) - 1]), BlockRemoved(block_hashes=[1]),
                       AllCleared()])
    assert EventCodec(None).decode(EventCodec(None).encode(batch)) == batch
    frame = EventCodec(SECRET).encode(batch)
    receiver = EventCodec(SECRET)
    assert receiver.decode(frame) == batch
    for bad, reason in [(frame, "unauthenticated"),  # the same frame again: a replay
                        (EventCodec("another-secret-0123456789").encode(batch), "unauthenticated"),
                        (EventCodec(None).encode(batch), "unauthenticated"),  # bare, to a sealed subscriber
                        (frame[:-1] + bytes([frame[-1] ^ 1]), "unauthenticated")]:
        with pytest.raises(Malformed) as err:
            receiver.decode(bad)
        assert err.value.reason == reason
    open_codec = EventCodec(None)
    for junk in [b"", b"\xff\x00garbage", msgspec.msgpack.encode({"type": "kv_events", "seq": -1}),
                 msgspec.msgpack.encode({**msgspec.to_builtins(batch), "block_size": 0}),
                 msgspec.msgpack.encode({**msgspec.to_builtins(batch), "events": [{"type": "stored", "block_hashes": [-5],
                                                                                    "parent_hash": None}]})]:
        with pytest.raises(Malformed) as err:
            open_codec.decode(junk)
        assert err.value.reason == "malformed"
    with pytest.raises(Malformed):
        decode_snapshot(b'{"type": "kv_snapshot", "seq": 1}')


# ---- the index -----------------------------------------------------------------------------------


def _synced(blocks: set[int], seq: int = 5) -> WorkerIndex:
    idx = WorkerIndex("w")
    from common.kv_events import KVSnapshot

    assert idx.load(KVSnapshot(instance_id="i1", seq=seq, block_size=4, role="prefill", blocks=sorted(blocks))) == []
    return idx


def test_index_applies_in_order_and_drops_replays_gaps_and_strangers() -> None:
    idx = _synced({1, 2})
    assert idx.apply(_batch(6, [BlockStored(parent_hash=2, block_hashes=[3, 4])])) == "applied"
    assert idx.blocks == {1, 2, 3, 4}
    assert idx.apply(_batch(6, [BlockRemoved(block_hashes=[1, 2, 3, 4])])) == "replayed"  # seq seen: dropped
    assert idx.apply(_batch(2, [AllCleared()])) == "replayed"  # out of order: dropped
    assert idx.blocks == {1, 2, 3, 4} and idx.seq == 6
    assert idx.apply(_batch(6, [])) == "heartbeat"
    assert idx.apply(_batch(7, [BlockStored(parent_hash=None, block_hashes=[9])], block_size=8)) == "malformed"
    assert idx.apply(_batch(7, [BlockRemoved(block_hashes=[4])])) == "applied"
    assert idx.matched_blocks([1, 2, 3, 4]) == 3
    assert idx.apply(_batch(9, [AllCleared()])) == "gap" and not idx.synced  # 8 was lost: resync
    assert idx.apply(_batch(10, [AllCleared()])) == "buffered"  # held until the snapshot


def test_a_heartbeat_ahead_and_a_new_instance_both_resync() -> None:
    idx = _synced({1})
    assert idx.apply(_batch(7, [])) == "gap" and not idx.synced
    idx = _synced({1})
    assert idx.apply(_batch(1, [BlockStored(parent_hash=None, block_hashes=[5])], instance="i2")) == "restarted"
    assert not idx.synced and idx.blocks == set() and idx.instance_id is None


def test_batches_waiting_for_the_snapshot_are_applied_after_it_unless_it_has_them() -> None:
    from common.kv_events import KVSnapshot

    idx = WorkerIndex("w")
    for seq, h in [(4, 40), (5, 50), (6, 60)]:
        assert idx.apply(_batch(seq, [BlockStored(parent_hash=None, block_hashes=[h])])) == "buffered"
    # The snapshot was taken at seq 5: it holds 40 and 50; only batch 6 is applied on top.
    assert idx.load(KVSnapshot(instance_id="i1", seq=5, block_size=4, role="prefill", blocks=[40, 50])) == ["applied"]
    assert idx.synced and idx.seq == 6 and idx.blocks == {40, 50, 60}


# ---- the radix cache's events, mirrored ----------------------------------------------------------


class Wire:
    """A PUB socket stand-in: the encoded frames, some of which may be lost."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.frames.append(data)


def _mirror(idx: WorkerIndex, log: KVEventLog, wire: Wire, codec: EventCodec, lose: bool) -> list[str]:
    log.flush()
    verdicts = []
    for frame in wire.frames:
        if lose:
            continue
        verdicts.append(idx.apply(codec.decode(frame)))
    wire.frames.clear()
    # The publisher's next heartbeat (every HEARTBEAT_S when idle) carries the seq: a lost last
    # batch is noticed then, not only at the next change.
    verdicts.append(idx.apply(KVEventBatch(instance_id=log.instance_id, seq=log.seq, block_size=log.block_size,
                                           role="prefill", ts=0.0, events=[])))
    if not idx.synced:  # what the subscriber does on a gap: start again from the snapshot
        verdicts += idx.load(log.snapshot())
        wire.frames.clear()
    return verdicts


@pytest.mark.parametrize("seed", [1, 2])
def test_the_index_predicts_every_match_through_evictions_resets_and_lost_batches(seed: int) -> None:
    rng = random.Random(seed)
    ps, alloc = 4, PageAllocator(40)
    cache = RadixCache(alloc, ps)
    wire = Wire()
    log = KVEventLog("prefill", ps, EventCodec(SECRET), wire, max_pending_blocks=5)  # type: ignore[arg-type]
    cache.events = log
    idx, codec = WorkerIndex("w"), EventCodec(SECRET)
    idx.load(log.snapshot())
    stems = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    seen: list[list[int]] = []
    verdicts: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.7:  # a prompt finishes: its full pages join the cache (evicting LRU leaves for room)
            prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            m = cache.match_prefix(prompt)
            cache.inc_lock(m.node)
            need = -(-len(prompt) // ps) - len(m.pages)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            new = alloc.alloc(need)
            if new is None:
                cache.dec_lock(m.node)
                continue
            cache.cache_finished(prompt, m.pages + new, m.node)
            seen.append(prompt)
        elif op < 0.8 and seen:
            p = rng.choice(seen)
            cache.discard_after(p, rng.randrange(len(p) // ps + 1))
        elif op < 0.85:
            cache.reset()
        else:
            cache.evict(rng.randrange(1, 6))
        verdicts += _mirror(idx, log, wire, codec, lose=rng.random() < 0.05)
        cache.check_integrity()
        for p in seen[-20:] + stems:
            assert idx.synced
            assert idx.matched_blocks(block_hashes(p, ps)) * ps == cache.peek_prefix_len(p), (step, p)
        assert len(idx.blocks) == cache.total_pages()
    assert {"applied", "gap"} <= set(verdicts)  # lost batches were noticed and healed
    assert log.counters.overflows > 0 and log.counters.removed_blocks > 0 and log.counters.cleared > 0


def test_a_snapshot_flushes_first_so_its_seq_is_exact() -> None:
    ps, alloc = 4, PageAllocator(8)
    cache = RadixCache(alloc, ps)
    wire = Wire()
    cache.events = log = KVEventLog("prefill", ps, EventCodec(None), wire)  # type: ignore[arg-type]
    pages = alloc.alloc(2)
    assert pages is not None
    cache.insert(list(range(8)), pages)
    snap = log.snapshot()
    assert snap.seq == 1 and len(wire.frames) == 1 and sorted(snap.blocks) == sorted(block_hashes(list(range(8)), ps))
    cache.reset()
    log.flush()
    assert EventCodec(None).decode(wire.frames[-1]).events == [AllCleared()]
    assert log.snapshot().blocks == [] and log.seq == 2


def test_an_event_the_log_cannot_name_never_breaks_the_cache() -> None:
    """Events attached after pages were cached (a bug) cannot hash their children: the cache's
    update still completes, nothing wrong is published, and the next batch makes subscribers resync."""
    ps, alloc = 4, PageAllocator(8)
    cache = RadixCache(alloc, ps)
    first = alloc.alloc(1)
    assert first is not None
    cache.insert([1, 2, 3, 4], first)
    wire = Wire()
    cache.events = log = KVEventLog("prefill", ps, EventCodec(None), wire)  # type: ignore[arg-type]
    more = alloc.alloc(1)
    assert more is not None
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], first + more)  # its parent page has no hash
    cache.evict(2)
    cache.check_integrity()
    assert cache.total_pages() == 0 and log.snapshot().blocks == []
    assert log.counters.overflows == 1 and log.seq == 1 and wire.frames == []  # seq skipped: a gap for all


def test_a_heartbeat_while_a_step_runs_says_only_what_was_sent() -> None:
    """The heartbeat thread may beat in the middle of a step: it carries the last sent seq, never
    the step's own (still pending) events, so a subscriber stays in sync through it and applies
    the step's batch when the step flushes."""
    now = [100.0]
    ps, alloc = 4, PageAllocator(8)
    cache = RadixCache(alloc, ps)
    wire = Wire()
    codec = EventCodec(None)
    cache.events = log = KVEventLog("prefill", ps, codec, wire, clock=lambda: now[0])  # type: ignore[arg-type]
    idx = WorkerIndex("w")
    idx.load(log.snapshot())
    log.heartbeat_if_due()
    assert wire.frames == []  # not due yet
    pages = alloc.alloc(2)
    assert pages is not None
    cache.insert(list(range(8)), pages)  # the step's events: pending
    now[0] += 1.0
    log.heartbeat_if_due()
    beat = codec.decode(wire.frames[-1])
    assert beat.events == [] and beat.seq == 0 and idx.apply(beat) == "heartbeat" and idx.synced
    log.flush()  # the step ends
    batch = codec.decode(wire.frames[-1])
    assert batch.seq == 1 and idx.apply(batch) == "applied"
    assert idx.matched_blocks(block_hashes(list(range(8)), ps)) == 2 and log.counters.heartbeats == 1


def test_the_publisher_beats_while_the_loop_is_stuck_in_a_long_step() -> None:
    """A real PUB socket, and a scheduler that never flushes (one long forward): the subscriber
    still hears a heartbeat at least every HEARTBEAT_S, so it does not give the node up as silent."""
    pub = KVEventPublisher("prefill", 4, "127.0.0.1", 0, SECRET)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.info.endpoint)
        codec = EventCodec(SECRET)
        seen = []
        end = time.monotonic() + 3.2 * HEARTBEAT_S
        while time.monotonic() < end:
            if sub.poll(timeout=100):
                seen.append((time.monotonic(), codec.decode(sub.recv())))
        assert len(seen) >= 2, seen  # the first beats may go out before the connect completes
        gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
        assert all(g <= 1.6 * HEARTBEAT_S for g in gaps), gaps
        assert all(b.events == [] and b.seq == 0 and b.instance_id == pub.log.instance_id for _, b in seen)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()
    assert not pub._beats.is_alive()
