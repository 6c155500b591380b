"""RadixCache: random request flows against a model (hypothesis stateful tests); the hand-checked
scenarios are in test_radix_cache.

The model is a dict from each cached page-aligned prefix (a tuple of tokens) to the page that
holds its last page of KV, plus per-prefix lock counts and last-access ticks. It knows nothing
of trees, splits or nodes; it predicts every match, every insert's result, which pages each call
frees, and the exact LRU eviction order.
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.kvcache.allocator import PageAllocator
from common.kvcache.radix_cache import RadixCache
from tests.unit.test_radix_cache import free_set


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
