"""RadixCache: hand-checked scenarios (page-granular matching, inserts that free duplicates or
refuse pages they cannot own, locks across splits, LRU eviction, reset, the chunked request
protocol, the disabled cache). Random request flows against a model are in test_radix_cache_model,
which imports ``free_set`` from here.
"""
from __future__ import annotations

import pytest

from common.kvcache.allocator import KVAccountingError, PageAllocator
from common.kvcache.radix_cache import RadixCache


def free_set(alloc: PageAllocator) -> set[int]:
    return {p for p in range(1, alloc.num_pages) if not alloc.is_allocated(p)}


def setup_cache(num_pages: int = 32, page_size: int = 4, enabled: bool = True) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size, enabled)


def take(alloc: PageAllocator, n: int) -> list[int]:
    pages = alloc.alloc(n)
    assert pages is not None
    return pages


def test_match_is_page_granular() -> None:
    alloc, cache = setup_cache()
    pages = take(alloc, 2)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], pages) == 0
    hit = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 10])
    assert (hit.pages, hit.num_tokens) == (pages[:1], 4)
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0  # not a whole page
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).pages == pages
    cache.check_integrity()


def test_max_tokens_keeps_tokens_to_compute() -> None:
    alloc, cache = setup_cache()
    seq = list(range(8))
    cache.insert(seq, take(alloc, 2))
    assert cache.match_prefix(seq).num_tokens == 8
    assert cache.match_prefix(seq, max_tokens=len(seq) - 1).num_tokens == 4
    nothing = cache.match_prefix(seq, max_tokens=0)
    assert nothing.num_tokens == 0 and nothing.node is cache.root
    cache.inc_lock(nothing.node)  # the root handle is a harmless no-op
    assert cache.protected_pages() == 0


def test_lock_survives_later_splits() -> None:
    alloc, cache = setup_cache()
    seq = list(range(12))
    cache.insert(seq, take(alloc, 3))
    hit = cache.match_prefix(seq)
    assert cache.inc_lock(hit.node) == 3
    cache.match_prefix(seq[:4] + [99] * 4)  # splits the edge after one page
    cache.match_prefix(seq[:8])  # and after two
    cache.check_integrity()
    assert cache.protected_pages() == 3 and cache.evict(10) == 0
    assert cache.dec_lock(hit.node) == 3
    assert cache.evict(10) == 3 and alloc.num_free == alloc.num_total
    cache.check_integrity()


def test_insert_frees_duplicates_and_keeps_its_own_pages() -> None:
    alloc, cache = setup_cache()
    seq = list(range(12))
    first, second = take(alloc, 3), take(alloc, 3)  # two requests computed the same prompt
    assert cache.insert(seq[:8], first[:2]) == 0
    free_before = free_set(alloc)
    # The second passes its own copies for the two cached pages plus one new page.
    assert cache.insert(seq, second) == 8
    assert free_set(alloc) - free_before == set(second[:2])
    assert cache.match_prefix(seq).pages == first[:2] + second[2:]
    # Re-inserting the cache's own pages is a no-op.
    assert cache.insert(seq, first[:2] + second[2:]) == 12
    assert free_set(alloc) - free_before == set(second[:2])
    alloc.free([first[2]])
    cache.check_integrity()
    assert alloc.num_free + cache.total_pages() == alloc.num_total


def test_insert_rejects_pages_it_cannot_own() -> None:
    alloc, cache = setup_cache()
    seq = list(range(8))
    pages = take(alloc, 2)
    cache.insert(seq, pages)
    mine = take(alloc, 1)
    free_page = sorted(free_set(alloc))[0]
    cases = [
        (seq, [free_page]),  # never allocated
        ([7] * 8, [mine[0], mine[0]]),  # listed twice
        ([5] * 4, [pages[0]]),  # cached already, for other tokens
        (seq, [pages[1], mine[0]]),  # cached already, at another position
    ]
    for tokens, bad in cases:
        with pytest.raises(KVAccountingError):
            cache.insert(tokens, bad)
        assert alloc.is_allocated(mine[0]) and cache.total_pages() == 2
        cache.check_integrity()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], mine)  # fewer tokens than the page holds


def test_evict_is_lru_and_trims_exactly() -> None:
    alloc, cache = setup_cache()
    a, b, c = ([t] * 8 for t in (1, 2, 3))
    pa, pb, pc = take(alloc, 2), take(alloc, 2), take(alloc, 2)
    for seq, pages in ((a, pa), (b, pb), (c, pc)):
        cache.insert(seq, pages)
    cache.match_prefix(a)  # least recently used first: b, c, a
    before = free_set(alloc)
    assert cache.evict(1) == 1 and free_set(alloc) - before == {pb[1]}  # b's tail page only
    before = free_set(alloc)
    assert cache.evict(2) == 2 and free_set(alloc) - before == {pb[0], pc[1]}
    assert cache.match_prefix(b).num_tokens == 0
    assert cache.match_prefix(c).pages == pc[:1] and cache.match_prefix(a).pages == pa
    assert cache.evict(100) == 3 and cache.total_pages() == 0
    cache.check_integrity()


def test_lock_misuse_is_loud() -> None:
    alloc, cache = setup_cache()
    seq = list(range(8))
    cache.insert(seq, take(alloc, 2))
    hit = cache.match_prefix(seq)
    with pytest.raises(KVAccountingError):
        cache.dec_lock(hit.node)  # never locked
    cache.evict(2)
    with pytest.raises(KVAccountingError):
        cache.inc_lock(hit.node)  # evicted between match and lock
    cache.check_integrity()


def test_reset_refuses_while_locked() -> None:
    alloc, cache = setup_cache()
    seq = list(range(8))
    cache.insert(seq, take(alloc, 2))
    hit = cache.match_prefix(seq)
    cache.inc_lock(hit.node)
    assert cache.reset() is False and cache.total_pages() == 2
    cache.dec_lock(hit.node)
    miss = cache.match_prefix([42] * 4)  # a request that matched nothing holds the root
    cache.inc_lock(miss.node)
    assert cache.reset() is True
    assert cache.total_pages() == 0 and alloc.num_free == alloc.num_total
    cache.dec_lock(miss.node)  # the root handle outlives a reset
    assert cache.match_prefix(seq).num_tokens == 0
    with pytest.raises(KVAccountingError):
        cache.inc_lock(hit.node)
    cache.check_integrity()


def test_chunked_request_protocol() -> None:
    alloc, cache = setup_cache()
    prompt = list(range(10))
    # A request computes its first chunk, 6 tokens, on 2 pages (the second partly filled).
    hit = cache.match_prefix(prompt, max_tokens=len(prompt) - 1)
    assert hit.num_tokens == 0
    cache.inc_lock(hit.node)
    pages = take(alloc, 2)
    done = cache.cache_unfinished(prompt[:6], pages, hit.node)
    assert done.pages == pages[:1] and cache.protected_pages() == 1
    # Second chunk: tokens 6..9 need one more page.
    pages = done.pages + pages[1:] + take(alloc, 1)
    # Meanwhile another request cached tokens 4..7 on its own page.
    other = take(alloc, 1)
    assert cache.insert(prompt[:8], [done.pages[0], other[0]]) == 4
    before = free_set(alloc)
    assert cache.cache_finished(prompt, pages, done.node) == 8
    assert free_set(alloc) - before == {pages[1], pages[2]}  # the duplicate and the partial tail
    assert cache.protected_pages() == 0 and cache.total_pages() == 2
    assert alloc.num_free + cache.total_pages() == alloc.num_total
    cache.check_integrity()


def test_disabled_cache_needs_no_special_casing() -> None:
    alloc, cache = setup_cache(enabled=False)
    seq = list(range(10))
    hit = cache.match_prefix(seq)
    assert hit.num_tokens == 0 and hit.pages == []
    cache.inc_lock(hit.node)
    pages = take(alloc, 3)
    kept = cache.cache_unfinished(seq, pages, hit.node)
    assert kept.pages == pages[:2] and alloc.num_free == alloc.num_total - 3
    assert cache.cache_finished(seq, pages, kept.node) == 0
    assert alloc.num_free == alloc.num_total
    assert cache.insert(seq, take(alloc, 2)) == 0 and alloc.num_free == alloc.num_total
    assert cache.evict(5) == 0 and cache.reset() is True
    cache.check_integrity()
