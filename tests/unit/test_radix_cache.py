"""RadixCache: hand-checked scenarios, then random request flows against a model.

The model is a dict from each cached page-aligned prefix (a tuple of tokens) to the page that
holds its last page of KV, plus per-prefix lock counts and last-access ticks. It knows nothing
of trees, splits or nodes; it predicts every match, every insert's result, which pages each call
frees, and the exact LRU eviction order.
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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


# ----------------------------------------------------------------------------------------------
# Random request flows against the model


def page_patterns(page_size: int) -> list[list[int]]:
    """A few page-long token patterns; pattern 3 equals pattern 0 except for its last token, so
    a page that matches only partly must not count as matched."""
    base = [[j * 100 + t for t in range(page_size)] for j in range(3)]
    return [*base, base[0][:-1] + [999]] if page_size > 1 else base


class RadixMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    ENABLED = True
    NUM_PAGES = 30

    @initialize()
    def setup(self) -> None:
        self.ps = self.PAGE_SIZE
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.cache = RadixCache(self.alloc, self.ps, self.ENABLED)
        self.patterns = page_patterns(self.ps)
        self.model: dict[tuple[int, ...], int] = {}  # cached prefix -> page of its last page
        self.ticks: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.now = 0
        # In-flight requests: tokens, row pages, own (uncached) pages, lock node, locked prefix pages.
        self.reqs: list[dict] = []

    # -- model -----------------------------------------------------------------------------

    def prefix(self, seq: list[int], i: int) -> tuple[int, ...]:
        return tuple(seq[: i * self.ps])

    def model_match(self, seq: list[int], max_tokens: int | None = None) -> list[int]:
        self.now += 1
        limit = len(seq) if max_tokens is None else min(len(seq), max_tokens)
        pages: list[int] = []
        while len(pages) < limit // self.ps and self.prefix(seq, len(pages) + 1) in self.model:
            key = self.prefix(seq, len(pages) + 1)
            pages.append(self.model[key])
            self.ticks[key] = self.now
        return pages

    def model_insert(self, seq: list[int], pages: list[int]) -> tuple[int, set[int]]:
        """(tokens already cached, pages the call frees)."""
        if not self.ENABLED:
            return 0, set(pages)
        self.now += 1
        cached, freed = 0, set()
        for i, page in enumerate(pages, 1):
            key = self.prefix(seq, i)
            if key in self.model:
                cached += self.ps
                if self.model[key] != page:
                    freed.add(page)
            else:
                self.model[key], self.locks[key] = page, 0
            self.ticks[key] = self.now
        return cached, freed

    def model_evict(self, n: int) -> set[int]:
        freed: set[int] = set()
        while len(freed) < n:
            inner = {key[: -self.ps] for key in self.model}
            leaves = [k for k in self.model if self.locks[k] == 0 and k not in inner]
            if not leaves:
                break
            victim = min(leaves, key=self.ticks.__getitem__)
            freed.add(self.model.pop(victim))
            del self.ticks[victim], self.locks[victim]
        return freed

    def lock(self, seq: list[int], num_pages: int, delta: int) -> None:
        for i in range(1, num_pages + 1):
            self.locks[self.prefix(seq, i)] += delta

    # -- helpers ---------------------------------------------------------------------------

    def tokens(self, data: st.DataObject, min_pages: int) -> list[int]:
        chosen = data.draw(st.lists(st.sampled_from(self.patterns), min_size=min_pages, max_size=4))
        tail = data.draw(st.integers(0, self.ps - 1))
        return [t for page in chosen for t in page] + self.patterns[1][:tail]

    def alloc_or_evict(self, n: int) -> list[int] | None:
        pages = self.alloc.alloc(n)
        if pages is None:
            self.evict_and_compare(n - self.alloc.num_free)
            pages = self.alloc.alloc(n)
        return pages

    def evict_and_compare(self, n: int) -> None:
        before, evictable = free_set(self.alloc), self.cache.evictable_pages()
        expected = self.model_evict(n)
        assert self.cache.evict(n) == len(expected) == min(max(n, 0), evictable)
        assert free_set(self.alloc) - before == expected

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        seq = self.tokens(data, min_pages=1)
        hit = self.cache.match_prefix(seq, max_tokens=len(seq) - 1)
        expected = self.model_match(seq, len(seq) - 1)
        assert hit.pages == expected and hit.num_tokens == len(expected) * self.ps
        self.cache.inc_lock(hit.node)
        self.lock(seq, len(expected), +1)
        own = self.alloc_or_evict(-(-len(seq) // self.ps) - len(expected))
        if own is None:  # does not fit: give the lock back
            self.cache.dec_lock(hit.node)
            self.lock(seq, len(expected), -1)
            return
        self.reqs.append({"seq": seq, "pages": hit.pages + own, "own": own, "node": hit.node, "locked": len(expected)})

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def extend_request(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        seq = req["seq"] + self.tokens(data, min_pages=0)
        more = self.alloc_or_evict(-(-len(seq) // self.ps) - len(req["pages"]))
        if more is not None:
            req["seq"], req["pages"], req["own"] = seq, req["pages"] + more, req["own"] + more

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def chunk_done(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        seq, pages, full = req["seq"], req["pages"], len(req["seq"]) // self.ps
        before = free_set(self.alloc)
        result = self.cache.cache_unfinished(seq, pages, req["node"])
        if not self.ENABLED:
            assert result.pages == pages[:full] and free_set(self.alloc) == before
            return
        _, freed = self.model_insert(seq, pages[:full])
        assert result.pages == self.model_match(seq[: full * self.ps])
        assert free_set(self.alloc) - before == freed
        self.lock(seq, full, +1)
        self.lock(seq, req["locked"], -1)
        req.update(pages=result.pages + pages[full:], own=pages[full:], node=result.node, locked=full)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        seq, pages, full = req["seq"], req["pages"], len(req["seq"]) // self.ps
        before = free_set(self.alloc)
        cached, freed = self.model_insert(seq, pages[:full])
        assert self.cache.cache_finished(seq, pages, req["node"]) == cached
        assert free_set(self.alloc) - before == freed | set(pages[full:])
        self.lock(seq, req["locked"], -1)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.alloc.free(req["own"])
        self.cache.dec_lock(req["node"])
        self.lock(req["seq"], req["locked"], -1)

    @rule(data=st.data())
    def insert_without_matching(self, data: st.DataObject) -> None:
        seq = self.tokens(data, min_pages=1)
        pages = self.alloc_or_evict(len(seq) // self.ps)
        if pages is None:
            return
        before = free_set(self.alloc)
        cached, freed = self.model_insert(seq, pages)
        assert self.cache.insert(seq, pages) == cached
        assert free_set(self.alloc) - before == freed

    @rule(data=st.data())
    def match_only(self, data: st.DataObject) -> None:
        seq = self.tokens(data, min_pages=0)
        max_tokens = data.draw(st.none() | st.integers(0, len(seq)))
        hit = self.cache.match_prefix(seq, max_tokens)
        expected = self.model_match(seq, max_tokens) if self.ENABLED else []
        assert hit.pages == expected and hit.num_tokens == len(expected) * self.ps

    @rule(n=st.integers(-1, 12))
    def evict(self, n: int) -> None:
        self.evict_and_compare(n)

    @rule()
    def reset(self) -> None:
        locked = any(self.locks.values())
        before = free_set(self.alloc)
        assert self.cache.reset() is (not locked)
        if not locked:
            assert free_set(self.alloc) - before == set(self.model.values())
            self.model.clear()
            self.ticks.clear()
            self.locks.clear()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        self.cache.check_integrity()
        self.alloc.check_integrity()
        own = [p for req in self.reqs for p in req["own"]]
        assert len(own) == len(set(own)), "two requests own one page"
        held = set(own)
        cached = {p for p in range(1, self.alloc.num_pages) if self.alloc.is_allocated(p)} - held
        assert cached == set(self.model.values())
        assert self.alloc.num_free + self.cache.total_pages() + len(held) == self.alloc.num_total
        assert self.cache.protected_pages() == sum(1 for n in self.locks.values() if n > 0)


def machine(page_size: int, enabled: bool, num_pages: int) -> type[RadixMachine]:
    return type(
        f"RadixMachinePs{page_size}{'' if enabled else 'Disabled'}",
        (RadixMachine,),
        {"PAGE_SIZE": page_size, "ENABLED": enabled, "NUM_PAGES": num_pages},
    )


_SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestRadixPageSize1 = machine(1, True, 14).TestCase
TestRadixPageSize1.settings = _SETTINGS
TestRadixPageSize16 = machine(16, True, 14).TestCase
TestRadixPageSize16.settings = _SETTINGS
TestRadixDisabled = machine(4, False, 14).TestCase
TestRadixDisabled.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
