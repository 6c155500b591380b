"""KV integrity (common/kvcache/page_digest.py): bytes in the KV pool that our forward did not
write are never served. A write through the data plane lands in the pool tensors; these tests
write there the same way (the bytes of the registered buffers) and check that

    the prefix cache       drops a poisoned branch and recomputes from its first changed page
    the decode             fails a request whose arrived KV differs from what the prefill digested
    the digest itself      covers every layer, K and V, only the valid part of a last page, and
                           depends on the cluster's key

The decode scheduler runs on the fake rig of test_decode_scheduler.py, with a real pool beside it."""
from __future__ import annotations

import pytest
import torch

from common.kvcache.allocator import PageAllocator
from common.kvcache.page_digest import PageDigests, digest_key
from common.kvcache.pool import KVLayout, KVPool
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from tests.unit.test_decode_scheduler import PS, Rig, next_token
from transfer.aux import AuxRecord

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=PS, dtype="float32")
KEY = digest_key("cluster-secret-0123456789abcdef")


def pool(num_pages: int = 33) -> KVPool:
    return KVPool(LAYOUT, num_pages, "cpu")


def fill(p: KVPool, pages: list[int], seed: int) -> None:
    """What a forward would write: distinct values in every layer, K and V, of ``pages``."""
    g = torch.Generator().manual_seed(seed)
    for buf in p.buffers():
        for page in pages:
            buf[page * PS : (page + 1) * PS] = torch.randn(PS, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)


def poke(p: KVPool, page: int, layer_buffer: int = 0, offset: int = 0) -> None:
    """One float changed in one buffer: a write through the data plane."""
    p.buffers()[layer_buffer][page * PS + offset, 0, 0] += 1.0


def test_a_change_anywhere_in_a_page_is_noticed_and_only_there() -> None:
    p = pool()
    fill(p, [1, 2, 3], seed=0)
    d = PageDigests(p.buffers(), PS, p.num_pages, KEY)
    d.record([1, 2, 3])
    assert d.first_mismatch([1, 2, 3]) is None
    for buffer in range(2 * LAYOUT.num_layers):  # every layer, K then V
        poke(p, 2, buffer, offset=PS - 1)
        assert d.first_mismatch([1, 2, 3]) == 1, buffer
        d.record([2])  # as if a forward wrote it anew
    assert d.first_mismatch([4]) == 0  # never recorded: never trusted


def test_a_partial_last_page_counts_only_its_valid_tokens() -> None:
    src, dst = pool(), pool()
    fill(src, [1, 2], seed=1)
    d_src = PageDigests(src.buffers(), PS, src.num_pages, KEY)
    d_src.record([1])
    d_src.record([2], valid_last=1)
    digest = d_src.room_digest([1, 2], PS + 1)
    # The transfer: the valid bytes land on other page ids; the tail of the last page differs.
    for s, t in zip(src.buffers(), dst.buffers()):
        t[5 * PS : 6 * PS] = s[1 * PS : 2 * PS]
        t[9 * PS] = s[2 * PS]
        t[9 * PS + 1 :] = 7.0
    d_dst = PageDigests(dst.buffers(), PS, dst.num_pages, KEY)
    assert d_dst.arrived_intact([5, 9], PS + 1, digest)
    assert not d_dst.arrived_intact([5, 9], PS + 2, digest)  # another length: another digest
    poke(dst, 9, layer_buffer=4, offset=0)
    assert not d_dst.arrived_intact([5, 9], PS + 1, digest) and d_dst.failures == 2
    other = PageDigests(src.buffers(), PS, src.num_pages, digest_key(None))  # another cluster's key
    other.record([1])
    other.record([2], valid_last=1)
    assert other.room_digest([1, 2], PS + 1) != digest


def _memory(p: KVPool, pages: int = 32) -> KVMemory:
    alloc = PageAllocator(pages + 1)
    return KVMemory(alloc, ReqToTokenPool(4, 64, "cpu"), RadixCache(alloc, PS), PS,
                    digests=PageDigests(p.buffers(), PS, p.num_pages, KEY))


def _prefill(mem: KVMemory, p: KVPool, prompt: list[int], seed: int) -> int:
    """One request through admit / forward (fill + written) / release into the cache; its hit."""
    kv = mem.admit(prompt)
    assert kv is not None and mem.reserve(kv, len(prompt))
    fill(p, kv.pages[kv.num_cached // PS :], seed)
    mem.written(kv, kv.num_cached, len(prompt), final=True)
    hit = kv.num_cached
    kv.kv_len = len(prompt)
    mem.release(kv, prompt)
    mem.check_integrity()
    return hit


def test_a_poisoned_cached_page_is_recomputed_not_served() -> None:
    p = pool()
    mem = _memory(p)
    prompt = list(range(100, 100 + 4 * PS + 1))  # 4 full pages + 1 token
    assert _prefill(mem, p, prompt, seed=2) == 0
    assert _prefill(mem, p, prompt, seed=3) == 4 * PS  # every full page from the cache
    assert mem.digests is not None and mem.digests.failures == 0
    cached = mem.cache.match_prefix(prompt, max_tokens=4 * PS).pages
    poke(p, cached[2], layer_buffer=3)  # page 2 of the prompt, a V buffer
    assert _prefill(mem, p, prompt, seed=4) == 2 * PS  # served up to the poisoned page, recomputed after
    assert mem.digests.failures == 1 and mem.stats()["kv_integrity_failures"] == 1
    assert _prefill(mem, p, prompt, seed=5) == 4 * PS  # the recomputed pages are cached and trusted again
    assert mem.digests.failures == 1


def test_a_poisoned_branch_in_use_is_not_served_and_dropped_once_free() -> None:
    p = pool()
    mem = _memory(p)
    prompt = list(range(200, 200 + 3 * PS + 1))
    _prefill(mem, p, prompt, seed=6)
    holder = mem.admit(prompt)  # a live request reading the whole cached prefix (locks it)
    assert holder is not None and holder.num_cached == 3 * PS
    poke(p, holder.pages[1])
    assert _prefill(mem, p, prompt, seed=7) == PS  # not served, though it cannot be dropped yet
    assert mem.digests is not None and mem.digests.failures == 1
    mem.release(holder, None)
    mem.check_integrity()
    # Unlocked now: the next request meets it again, drops it, and the one after is served whole.
    assert _prefill(mem, p, prompt, seed=8) == PS and mem.digests.failures == 2
    assert _prefill(mem, p, prompt, seed=9) == 3 * PS and mem.digests.failures == 2


def test_the_decode_fails_a_request_whose_kv_is_not_what_the_prefill_digested() -> None:
    rig = Rig()
    p = pool(num_pages=rig.memory.allocator.num_total + 1)
    rig.memory.digests = PageDigests(p.buffers(), PS, p.num_pages, KEY)
    sender = PageDigests(p.buffers(), PS, p.num_pages, KEY)  # the prefill's view of the same bytes
    complete = rig.hub.complete

    def complete_with_digest(room: int, logprob: float = -0.5) -> None:
        complete(room, logprob)
        r = rig.hub.rx[room]
        prompt = rig.prompts[room]
        assert r.pages is not None and r.slot is not None
        fill(p, r.pages, seed=room)  # the KV that "arrived"
        n = len(prompt)
        sender.record(r.pages[:-1])
        sender.record(r.pages[-1:], valid_last=n - (len(r.pages) - 1) * PS)
        digest = sender.room_digest(r.pages, n)
        if room == 2:
            poke(p, r.pages[0], layer_buffer=5)  # written over after the prefill's write landed
        rig.aux.write(r.slot, AuxRecord(room=room, token_id=next_token(prompt), cached_tokens=0, kv_digest=digest))

    rig.hub.complete = complete_with_digest  # type: ignore[method-assign]
    rig.add("ok", list(range(10)), 4, room=1)
    rig.add("poisoned", list(range(20, 30)), 4, room=2)
    rig.run()
    assert rig.final("ok").finish is not None and rig.final("ok").finish.type == "length"  # type: ignore[union-attr]
    bad = rig.final("poisoned")
    assert bad.error is not None and "KV integrity check failed" in bad.error and bad.http_status == 502, bad
    assert rig.tokens("poisoned") == []  # nothing decoded from it
    assert rig.stats.metrics()["kv_integrity_failures_total"] == 1.0
    rig.assert_clean()


def test_the_batched_path_digests_the_same_bytes_as_the_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path (pages gathered in batches, hashed by a thread pool), run on CPU tensors, gives
    the host path's digests: a CPU node and a GPU node of one cluster agree. Batches of 2 pages
    make several batches and a remainder; a partial last page goes the single-page way."""
    import common.kvcache.page_digest as page_digest

    p = pool()
    fill(p, list(range(1, 12)), seed=5)
    host = PageDigests(p.buffers(), PS, p.num_pages, KEY)
    page_bytes = sum(b[:PS].numel() * b.element_size() for b in p.buffers())
    monkeypatch.setattr(page_digest, "STAGING_BYTES", 2 * page_bytes)
    batched = PageDigests(p.buffers(), PS, p.num_pages, KEY, batched=True, threads=3)
    assert batched._per_batch == 2
    pages = [7, 1, 2, 9, 3]
    assert batched.compute_many(pages) == host.compute_many(pages) == [host.compute(q) for q in pages]
    assert batched.compute_many(pages, valid_last=PS - 1) == host.compute_many(pages, valid_last=PS - 1)
    assert batched.compute_many(pages, valid_last=PS - 1)[-1] == host.compute(3, PS - 1)
    batched.record(pages)
    assert batched.first_mismatch(pages) is None
    poke(p, 9, layer_buffer=2 * LAYOUT.num_layers - 1, offset=1)
    assert batched.first_mismatch(pages) == 3
    host.record([1, 2], valid_last=PS - 1)
    assert batched.arrived_intact([1, 2], 2 * PS - 1, host.room_digest([1, 2], 2 * PS - 1))
