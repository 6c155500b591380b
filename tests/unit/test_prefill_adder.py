"""PrefillAdder budgets and queue policy, on hand-made numbers (no pools, no model)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.admission import LPM_MAX_QUEUE, PrefillAdder, PrefillBudget, order_waiting, pages_for


def adder(max_tokens: int, chunk: int | None, pages: int = 10_000, page_size: int = 1) -> PrefillAdder:
    return PrefillAdder(PrefillBudget(max_tokens, chunk), available_pages=pages, page_size=page_size)


def test_token_budget_without_chunking_takes_whole_prompts_only() -> None:
    a = adder(25, None)
    assert a.add_new(10, 0) == 10
    assert a.add_new(10, 0) == 10
    assert a.add_new(10, 0) is None  # 5 tokens left: a whole prompt or nothing
    assert a.add_new(5, 0) == 5
    assert a.closed and a.batch_tokens == 25


def test_without_chunking_an_oversized_prompt_runs_alone() -> None:
    a = adder(8, None)
    assert a.add_new(20, 0) == 20
    assert a.closed
    assert a.add_new(1, 0) is None
    b = adder(8, None)
    assert b.add_new(4, 0) == 4
    assert b.add_new(20, 0) is None  # not first: it waits for a batch of its own


def test_chunked_prefill_sequence_keeps_one_partial_request() -> None:
    # step 1: the 20-token prompt is cut to the chunk size and closes the batch
    a = adder(32, 8)
    assert a.add_new(20, 0) == 8
    assert a.closed and a.add_new(3, 0) is None
    # step 2: it continues first, still bounded by the chunk size; a short prompt joins whole,
    # one that would be cut does not (it would be a second partial request), and stops the adding
    a = adder(32, 8)
    assert a.add_chunked(12) == 8
    assert not a.closed and a.whole_only
    assert a.can_add(6, 0) and a.add_new(6, 0) == 6
    assert not a.can_add(9, 0) and a.add_new(9, 0) is None
    assert a.waits_for_chunk(9, 0) and a.waits_for_chunk(16, 4)  # cut: it cannot start this step
    assert not a.waits_for_chunk(6, 0) and not a.waits_for_chunk(12, 8)  # whole: it could
    assert a.batch_tokens == 14
    # step 3: it finishes; new prompts fill the rest, the last one becomes the chunked request
    a = adder(32, 8)
    assert a.add_chunked(4) == 4 and not a.closed and not a.whole_only
    assert not a.waits_for_chunk(30, 0)  # no other request is chunked: it starts, cut, now
    assert a.add_new(5, 0) == 5
    assert a.add_new(30, 0) == 8 and a.closed
    assert not a.waits_for_chunk(3, 0)  # closed: nothing more this step
    assert a.batch_tokens == 17


def test_a_continuing_chunk_that_spends_the_budget_closes_the_batch() -> None:
    a = adder(8, 8)
    assert a.add_chunked(20) == 8 and a.closed
    assert a.add_new(1, 0) is None


def test_token_budget_cuts_a_chunk_short() -> None:
    a = adder(10, 8)
    assert a.add_new(6, 0) == 6
    assert a.add_new(9, 0) == 4  # only 4 tokens of budget left
    assert a.closed


def test_chunked_request_must_come_first() -> None:
    a = adder(32, 8)
    a.add_new(2, 0)
    with pytest.raises(ValueError):
        a.add_chunked(5)


def test_pages_reserve_the_whole_prompt_minus_cached_prefix() -> None:
    a = adder(1000, 4, pages=5, page_size=4)
    assert a.add_new(9, 0) == 4  # 3 pages reserved although only 4 tokens run now
    assert a.rem_pages == 2
    b = adder(1000, None, pages=5, page_size=4)
    assert b.add_new(9, 0) == 9
    assert b.add_new(9, 0) is None  # 3 pages needed, 2 left
    assert b.add_new(9, 4) == 5  # a one-page cached prefix: 2 new pages
    assert b.rem_pages == 0


def test_locking_a_cached_prefix_counts_against_capacity() -> None:
    a = adder(1000, None, pages=3, page_size=4)
    # 8 cached tokens (2 pages) that were evictable: locking them uses 2 of the 3 pages
    assert a.add_new(12, 8, lock_pages=2) == 4
    assert a.rem_pages == 0
    b = adder(1000, None, pages=2, page_size=4)
    assert b.add_new(12, 8, lock_pages=2) is None


def test_bad_cached_prefix_is_rejected() -> None:
    a = adder(100, None, page_size=4)
    with pytest.raises(ValueError):
        a.add_new(8, 8)  # at least one token must be computed
    with pytest.raises(ValueError):
        a.add_new(8, 3)  # prefixes are whole pages


def test_budget_from_flags() -> None:
    assert PrefillBudget.from_flags(100, 0).chunk_size is None
    assert PrefillBudget.from_flags(100, -1).chunk_size is None
    assert PrefillBudget.from_flags(100, 16).chunk_size == 16
    with pytest.raises(ValueError):
        PrefillBudget(0, None)


def test_fcfs_keeps_arrival_order_and_never_asks_for_prefixes() -> None:
    def boom(_: str) -> int:
        raise AssertionError("fcfs must not walk the cache")

    assert order_waiting(["a", "b", "c"], "fcfs", boom) == ["a", "b", "c"]


def test_lpm_orders_by_cached_prefix_then_arrival() -> None:
    prefix = {"a": 0, "b": 32, "c": 16, "d": 32, "e": 0}
    assert order_waiting(list("abcde"), "lpm", prefix.__getitem__) == ["b", "d", "c", "a", "e"]


def test_lpm_falls_back_to_fcfs_on_long_queues() -> None:
    reqs = list(range(LPM_MAX_QUEUE + 1))
    assert order_waiting(reqs, "lpm", lambda r: r) == reqs


@settings(max_examples=200, deadline=None)
@given(
    max_tokens=st.integers(1, 64),
    chunk=st.one_of(st.none(), st.integers(1, 32)),
    page_size=st.sampled_from([1, 4, 16]),
    pages=st.integers(0, 40),
    chunked_left=st.one_of(st.none(), st.integers(1, 100)),
    prompts=st.lists(st.tuples(st.integers(1, 80), st.integers(0, 5)), max_size=8),
)
def test_every_budget_holds_for_any_sequence(
    max_tokens: int, chunk: int | None, page_size: int, pages: int, chunked_left: int | None,
    prompts: list[tuple[int, int]],
) -> None:
    """Invariants of one step: token and chunk bounds, page capacity, at most one partial request."""
    a = PrefillAdder(PrefillBudget(max_tokens, chunk), available_pages=pages, page_size=page_size)
    slices: list[tuple[int, int]] = []  # (tokens this step, tokens left before the step)
    used_pages = 0
    if chunked_left is not None and chunk is not None:
        slices.append((a.add_chunked(chunked_left), chunked_left))
    for length, cached_pages in prompts:
        cached = min(cached_pages * page_size, (length - 1) // page_size * page_size)
        might = a.can_add(length, cached)
        n = a.add_new(length, cached)
        assert might or n is None, "can_add said no but add_new accepted"
        assert not might or n is not None, "without prefix locks, can_add is exact"
        if n is None:
            continue
        slices.append((n, length - cached))
        used_pages += pages_for(length, page_size) - cached // page_size
    total = sum(n for n, _ in slices)
    assert all(n >= 1 for n, _ in slices)
    if chunk is not None:
        assert all(n <= chunk for n, _ in slices)
        assert total <= max_tokens
    else:
        assert all(n == left for n, left in slices)  # no chunking: whole prompts
        assert total <= max_tokens or len(slices) == 1
    partial = [i for i, (n, left) in enumerate(slices) if n < left]
    # at most one partial request: the continuing one (first), or else the last one added
    continuing = chunked_left is not None and chunk is not None
    allowed = {len(slices) - 1} | ({0} if continuing else set())
    assert len(partial) <= 1 and all(i in allowed for i in partial)
    assert used_pages <= pages and a.rem_pages == pages - used_pages
    assert a.batch_tokens == total
