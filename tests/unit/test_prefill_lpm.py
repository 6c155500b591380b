"""Longest-prefix-match ordering must not change the prefix cache: it looks at every waiting prompt
each step, and most of them are not admitted, so stamping LRU ticks or splitting edges for them
would distort eviction (``RadixCache.peek_prefix_len`` against ``match_prefix`` as reference)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.kvcache.allocator import PageAllocator
from common.kvcache.radix_cache import RadixCache
from common.ipc.protocol import AbortReq
from tests.unit.test_prefill_scheduler import Node, gen, prompt
from transfer.poll import KVPoll


def tree_state(cache: RadixCache) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Every edge (key, pages, last access), in a canonical order."""
    return sorted((tuple(n.key), tuple(n.pages), n.last_access) for n in cache._nodes())


SEQ = st.lists(st.integers(0, 2), min_size=0, max_size=24)  # tiny alphabet: many shared prefixes


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), cached=st.lists(SEQ, max_size=6), queries=st.lists(SEQ, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 24)))
def test_peek_equals_match_and_changes_nothing(page_size: int, cached: list[list[int]], queries: list[list[int]],
                                               cut: int | None) -> None:
    alloc = PageAllocator(200)
    cache = RadixCache(alloc, page_size)
    for seq in cached:
        n = len(seq) // page_size
        pages = alloc.alloc(n)
        assert pages is not None
        cache.insert(seq, pages)
    for q in queries:
        before = tree_state(cache)
        got = cache.peek_prefix_len(q, cut)
        assert tree_state(cache) == before, "peek changed the tree"
        assert got == cache.match_prefix(q, cut).num_tokens
    cache.check_integrity()


def test_peek_on_a_disabled_cache_is_zero() -> None:
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, 4, enabled=False)
    assert cache.peek_prefix_len([1, 2, 3, 4, 5]) == 0


def test_lpm_steps_that_admit_nothing_leave_the_cache_untouched() -> None:
    node = Node(page_size=4, pages=12, policy="lpm")
    hot = prompt(12, base=70)
    node.step(gen("warm", hot, room=1))
    node.ready(1)
    node.step()
    node.sender(1).state = KVPoll.Success
    node.step()  # hot's 3 full pages are cached, in one edge
    node.step(gen("blocker", prompt(36, base=5), room=2))
    node.ready(2)
    node.step()  # holds the 9 free pages while its transfer runs; hot stays cached
    # Each shares part of hot's edge, but needs more pages than free + evictable: both wait.
    node.step(gen("x", hot[:8] + prompt(24, base=33), room=3), gen("y", hot[:4] + prompt(28, base=44), room=4))
    node.ready(3, 4)
    before = tree_state(node.memory.cache)
    assert len(before) == 1 and len(before[0][1]) == 3
    for _ in range(3):
        node.step()
    assert [r.rid for r in node.sched.queues.waiting] == ["x", "y"]
    assert tree_state(node.memory.cache) == before, "ordering waiting requests stamped or split the cache"
    node.step(AbortReq(rid="x"), AbortReq(rid="y"))
    node.sender(2).state = KVPoll.Success
    node.step()
    node.assert_idle()
