"""PageAllocator and page-index helpers, checked against plain-Python models."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.kvcache.allocator import (
    KVAccountingError,
    PageAllocator,
    contiguous_run_pairs,
    contiguous_runs,
    pages_to_slots,
)


def free_runs(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive pages in ``free``, by a route independent of the allocator."""
    runs: list[tuple[int, int]] = []
    for page in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def test_fresh_allocator_hands_out_usable_pages_only() -> None:
    alloc = PageAllocator(8)
    assert alloc.num_total == 7 and alloc.num_free == 7
    assert alloc.alloc(3) == [1, 2, 3]
    assert alloc.alloc(4) == [4, 5, 6, 7]
    assert alloc.alloc(1) is None
    assert alloc.num_free == 0 and alloc.num_used == 7
    assert not alloc.is_allocated(0)
    alloc.check_integrity()


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(6)
    assert alloc.alloc(6) is None  # only 5 usable
    assert alloc.num_free == 5
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError):
        alloc.alloc(-1)
    alloc.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [[0], [9], [-1], [3], [2, 2], [2, 9]],
    ids=["reserved", "out-of-range", "negative", "double-free", "twice-in-one-call", "valid-then-bad"],
)
def test_bad_free_is_loud_and_frees_nothing(bad: list[int]) -> None:
    alloc = PageAllocator(9)
    held = alloc.alloc(8)
    assert held is not None
    alloc.free([3])
    with pytest.raises(KVAccountingError):
        alloc.free(bad)
    assert alloc.num_free == 1 and alloc.is_allocated(2)
    alloc.check_integrity()


def test_freed_pages_coalesce_into_one_run() -> None:
    alloc = PageAllocator(33)
    singles = [alloc.alloc(1) for _ in range(32)]
    for i in [5, 0, 31, 17, 3, 2, 1, 4, *range(6, 17), *range(18, 31)]:
        page = singles[i]
        assert page is not None
        alloc.free(page)
    alloc.check_integrity()
    assert contiguous_runs(alloc.alloc(32) or []) == [(1, 32)]


def test_best_fit_keeps_long_runs_whole() -> None:
    alloc = PageAllocator(16)
    assert alloc.alloc(15) == list(range(1, 16))
    alloc.free([1, 3, 4, 5, 7, 8, 9, 10, 11])  # free runs of length 1, 3 and 5
    assert alloc.alloc(3) == [3, 4, 5]
    assert alloc.alloc(1) == [1]
    assert alloc.alloc(2) == [7, 8]
    alloc.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free against a model set of held pages."""

    @initialize(num_pages=st.integers(2, 40))
    def setup(self, num_pages: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.usable = set(range(1, num_pages))
        self.held: list[list[int]] = []

    def held_pages(self) -> set[int]:
        return {p for group in self.held for p in group}

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        free = self.usable - self.held_pages()
        n = data.draw(st.integers(0, len(self.usable) + 1), label="n")
        runs_before = free_runs(free)
        got = self.alloc.alloc(n)
        if n > len(free):
            assert got is None
            return
        assert got is not None and len(got) == n and got == sorted(got)
        assert set(got) <= free and len(set(got)) == n
        if n == 0:
            return
        fitting = [length for _, length in runs_before if length >= n]
        if fitting:
            # Best fit: one run, carved out of a shortest free run that holds n pages.
            assert len(contiguous_runs(got)) == 1
            (home_len,) = [length for start, length in runs_before if start <= got[0] < start + length]
            assert home_len == min(fitting)
        else:
            # Fewest runs: as many as the longest free runs need to cover n pages.
            lengths = sorted((length for _, length in runs_before), reverse=True)
            need = next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= n)
            assert len(contiguous_runs(got)) == need
        self.held.append(got)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        group = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="group"))
        give_back = data.draw(st.lists(st.sampled_from(group), unique=True), label="pages") if group else []
        keep = [p for p in group if p not in give_back]
        self.alloc.free(give_back)
        if keep:
            self.held.append(keep)

    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        free = sorted(self.usable - self.held_pages())
        bad = data.draw(st.sampled_from([0, -3, max(self.usable) + 1, *free]), label="bad page")
        before = self.alloc.num_free
        with pytest.raises(KVAccountingError):
            self.alloc.free([bad])
        assert self.alloc.num_free == before

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_integrity()
        held = self.held_pages()
        assert self.alloc.num_free + len(held) == self.alloc.num_total
        assert all(self.alloc.is_allocated(p) for p in held)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(
    pages=st.lists(st.integers(1, 1000), min_size=0, max_size=8),
    page_size=st.sampled_from([1, 2, 4, 16]),
    data=st.data(),
)
def test_pages_to_slots_matches_position_formula(pages: list[int], page_size: int, data: st.DataObject) -> None:
    num_tokens = data.draw(st.integers(0, len(pages) * page_size))
    slots = pages_to_slots(pages, page_size, num_tokens)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [pages[i // page_size] * page_size + i % page_size for i in range(num_tokens)]


def test_pages_to_slots_rejects_overflow() -> None:
    with pytest.raises(ValueError):
        pages_to_slots([1, 2], 4, 9)
    assert pages_to_slots(torch.tensor([3]), 4, 2).tolist() == [12, 13]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=20))
def test_contiguous_runs_cover_in_order_and_are_maximal(pages: list[int]) -> None:
    runs = contiguous_runs(pages)
    assert [start + i for start, length in runs for i in range(length)] == pages
    assert all(length >= 1 for _, length in runs)
    for (s0, n0), (s1, _) in zip(runs, runs[1:]):
        assert s1 != s0 + n0  # otherwise the two runs should have been one


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=20))
def test_contiguous_run_pairs_cover_both_sides_and_are_maximal(pairs: list[tuple[int, int]]) -> None:
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = contiguous_run_pairs(src, dst)
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == pairs
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert (s1, d1) != (s0 + n0, d0 + n0)
    with pytest.raises(ValueError):
        contiguous_run_pairs([1], [])
