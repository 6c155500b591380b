"""Radix (prefix) cache over KV pages: shares the KV of common prompt prefixes between requests.

Who owns a KV page (text for docs/ARCHITECTURE.md)
--------------------------------------------------
Every usable page is owned by exactly one of three parties at any time::

                 alloc                  insert / cache_finished
    allocator ------------> request --------------------------> cache
      ^    ^                   |                                  |
      |    +-------------------+ free: abort, failure,            |
      |                          partial tail page                |
      +-----------------------------------------------------------+
            evict (LRU, unlocked leaves) / reset / duplicates passed to insert

* **Allocator**: free pages. ``PageAllocator.alloc`` moves pages to the caller.
* **Request**: pages it allocated and has not yet given to the cache. Only the request may
  free them (abort, failure), or hand them to the cache.
* **Cache**: pages on some tree edge. The cache alone returns them to the allocator, by LRU
  eviction of *unlocked* leaves or by ``reset()``. A request reading cached pages (its
  matched prefix) must hold a lock on the node ``match_prefix`` returned, from right after
  the match until it no longer reads them; locked pages are never evicted.

``insert(token_ids, pages)`` **consumes every page passed**: afterwards the request owns none
of them. Per page position it either (a) finds the very same page already cached there (the
request got it from ``match_prefix``; nothing to do), (b) finds a *different* page caching the
same tokens (another request inserted them first) and frees the passed duplicate, or (c) keeps
the page as newly cached. Its return value (tokens already cached before the call) is for
statistics only; the caller frees nothing. A request that keeps computing after inserting
(chunked prefill) must re-match, because (b) freed pages its row still points at:
``cache_unfinished`` does insert + re-match + lock swap and returns the pages to write into
the row. A finished request hands its whole page list to ``cache_finished``: full pages are
inserted, the partially filled last page is freed, its lock is released.

With ``enabled=False`` the same calls work unchanged: ``match_prefix`` finds nothing (node =
root, whose lock is a no-op), ``insert`` frees every page at once and returns 0,
``cache_unfinished`` leaves the pages with the request and ``cache_finished`` frees them.

Pages handed to an in-flight KV transfer must stay put until the transfer reports
Success/Failed: do not insert them before then (an insert may free a duplicate the transfer
engine is still reading). The prefill node therefore inserts only when the transfer is done.

Capacity a scheduler can count on = ``allocator.num_free + cache.evictable_pages()``.

Tree shape
----------
Keys are token ids; every edge holds a whole number of pages (``len(key) == len(pages) *
page_size``); children are keyed by their first page of tokens::

    root
     +-- (1 2 3 4 | 5 6 7 8)  pages [9, 10]          page_size 4
          +-- (9 9 9 9)       pages [11]
          +-- (7 7 7 7)       pages [3]

``match_prefix`` splits an edge where the match ends so the returned node covers exactly the
matched pages (a lock then pins exactly those). On a split the existing node object keeps the
deeper part, so a handle held by a request still names the same path. Nodes carry the clock
tick of the last match/insert that reached them; eviction takes the least recently used
unlocked leaf and trims it from its tail so exactly the requested number of pages is freed.
Not thread-safe: the scheduler loop owns it.

KV events: with ``events`` set (``common/kvcache/kv_event_log.py``), every page that joins a tree
edge is reported as stored (after the page before it on its path), every page the cache frees as
removed, and ``reset`` as cleared: a subscriber mirrors exactly which blocks are cached.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from common.kvcache.allocator import KVAccountingError, PageAllocator
from common.kvcache.radix_node import MatchResult, RadixNode

if TYPE_CHECKING:
    from common.kvcache.kv_event_log import KVEventLog


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._ids = itertools.count()
        self._clock = 0
        self._owned = bytearray(allocator.num_pages)  # 1 where a tree edge holds the page
        # The root lives as long as the cache: requests that matched nothing hold it as handle.
        self.root = RadixNode(next(self._ids), [], [], None, 0)
        self._total = 0  # pages on tree edges
        self._protected = 0  # pages on locked edges
        self.events: KVEventLog | None = None  # set before the first insert, or it misses pages

    # -- accounting -------------------------------------------------------------------------

    def total_pages(self) -> int:
        return self._total

    def protected_pages(self) -> int:
        """Pages pinned by a lock."""
        return self._protected

    def evictable_pages(self) -> int:
        """Pages ``evict`` can return right now (every unlocked subtree is evictable leaf-first)."""
        return self._total - self._protected

    # -- match / insert ---------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids[:max_tokens]``.

        Pass ``max_tokens = len(token_ids) - 1`` to keep at least one token to compute.
        Lock the returned node (``inc_lock``) before anything can evict.
        """
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        num_pages = limit // self.page_size
        if not self.enabled or num_pages == 0:
            return MatchResult([], 0, self.root)
        node, num_tokens, pages = self._walk(list(token_ids[: num_pages * self.page_size]))
        return MatchResult(pages, num_tokens, node)

    def peek_prefix_len(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """``match_prefix(...).num_tokens`` without touching the tree (no LRU stamp, no split):
        for ordering decisions about requests that may not be admitted this step."""
        ps = self.page_size
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        key, node, pos = list(token_ids[: limit // ps * ps]), self.root, 0
        while self.enabled and pos < len(key):
            child = node.children.get(tuple(key[pos : pos + ps]))
            if child is None:
                break
            common = self._common_pages(child.key, key, pos)
            pos += common * ps
            if common < len(child.pages):
                break
            node = child
        return pos

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``token_ids[: len(pages) * page_size]`` on ``pages``; the cache takes every page.

        Returns how many leading tokens were already cached before the call (statistics only:
        duplicates among ``pages`` are freed here, see the module docstring). Raises
        ``KVAccountingError``, before changing any ownership, if a page is free, listed twice,
        or already cached at another position.
        """
        pages = list(pages)
        num_tokens = len(pages) * self.page_size
        if len(token_ids) < num_tokens:
            raise ValueError(f"{len(pages)} pages need {num_tokens} tokens, got {len(token_ids)}")
        self._check_held(pages)
        if not self.enabled:
            self.allocator.free(pages)
            return 0
        if not pages:
            return 0
        key = list(token_ids[:num_tokens])
        node, cached_tokens, cached_pages = self._walk(key)
        duplicates: list[int] = []
        for mine, theirs in zip(pages, cached_pages):
            if mine != theirs:
                if self._owned[mine]:
                    raise KVAccountingError(f"page {mine} is already cached at another position")
                duplicates.append(mine)
        new_pages = pages[len(cached_pages) :]
        for page in new_pages:
            if self._owned[page]:
                raise KVAccountingError(f"page {page} is already cached at another position")
        self.allocator.free(duplicates)
        if new_pages:
            leaf = RadixNode(next(self._ids), key[cached_tokens:], new_pages, node, self._clock)
            node.children[self._edge_key(leaf.key)] = leaf
            for page in new_pages:
                self._owned[page] = 1
            self._total += len(new_pages)
            if self.events is not None:
                self.events.stored(cached_pages[-1] if cached_pages else None, new_pages, leaf.key)
        return cached_tokens

    # -- request protocol helpers -----------------------------------------------------------

    def cache_finished(self, token_ids: Sequence[int], pages: Sequence[int], node: RadixNode) -> int:
        """A request is done: hand over its whole page list and release its lock on ``node``.

        ``token_ids[i]`` is the token whose KV sits at position ``i``; ``pages`` is every page of
        the request's row (matched prefix pages included). Full pages go to ``insert``; the
        partially filled tail page(s) are freed. Returns ``insert``'s result.
        """
        num_full = self._check_row(token_ids, pages)
        cached = self.insert(token_ids[: num_full * self.page_size], pages[:num_full])
        self.allocator.free(pages[num_full:])
        self.dec_lock(node)
        return cached

    def cache_unfinished(self, token_ids: Sequence[int], pages: Sequence[int], node: RadixNode) -> MatchResult:
        """A request keeps computing after this chunk: cache its full pages, keep them locked.

        Returns the prefix the request must now read from: write ``result.pages`` into its row
        for positions ``[0, result.num_tokens)`` (duplicates it held were freed), keep
        ``pages[len(result.pages):]`` as its own, and use ``result.node`` as its lock handle.
        """
        num_full = self._check_row(token_ids, pages)
        key = list(token_ids[: num_full * self.page_size])
        if not self.enabled:
            return MatchResult(list(pages[:num_full]), len(key), self.root)
        self.insert(key, pages[:num_full])
        result = self.match_prefix(key)
        if result.num_tokens != len(key):
            raise KVAccountingError(f"re-match after insert found {result.num_tokens} of {len(key)} tokens")
        self.inc_lock(result.node)
        self.dec_lock(node)
        return result

    # -- locks ------------------------------------------------------------------------------

    def inc_lock(self, node: RadixNode) -> int:
        """Pin the path root..node. Returns how many pages became protected."""
        if node.evicted:
            raise KVAccountingError(f"lock of evicted radix node {node.id} (lock right after match_prefix)")
        newly = 0
        while node is not self.root:
            if node.lock_ref == 0:
                newly += len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # only the root has no parent
        self._protected += newly
        return newly

    def dec_lock(self, node: RadixNode) -> int:
        """Undo one ``inc_lock(node)``. Returns how many pages became evictable."""
        if node.evicted:
            raise KVAccountingError(f"unlock of evicted radix node {node.id}")
        path = []
        while node is not self.root:
            if node.lock_ref <= 0:
                raise KVAccountingError(f"unlock of radix node {node.id}, which is not locked")
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        released = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                released += len(n.pages)
        self._protected -= released
        return released

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages of least recently used unlocked leaves. Returns pages freed
        (``min(num_pages, evictable_pages())``)."""
        if num_pages <= 0 or not self.enabled:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - freed
            if len(leaf.pages) > need:
                # Keep the head of the edge; the original object (the tail) is evicted whole.
                self._split(leaf, len(leaf.pages) - need)
            parent = leaf.parent
            assert parent is not None  # leaves are never the root: it is not in _nodes()
            del parent.children[self._edge_key(leaf.key)]
            leaf.evicted = True
            self.allocator.free(leaf.pages)
            if self.events is not None:
                self.events.removed(leaf.pages)
            for page in leaf.pages:
                self._owned[page] = 0
            self._total -= len(leaf.pages)
            freed += len(leaf.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def discard_after(self, token_ids: Sequence[int], num_pages: int) -> int:
        """Drop the cached branch that continues ``token_ids[: num_pages * page_size]`` along
        ``token_ids`` (the edge starting at page ``num_pages`` and everything below it), unless a
        lock pins part of it (then it stays until unlocked and evicted). Pages freed."""
        ps = self.page_size
        if not self.enabled or len(token_ids) < (num_pages + 1) * ps:
            return 0
        head = self.match_prefix(token_ids, max_tokens=num_pages * ps)  # splits so head.node ends there
        if head.num_tokens != num_pages * ps:
            return 0
        child = head.node.children.get(tuple(token_ids[num_pages * ps : (num_pages + 1) * ps]))
        if child is None:
            return 0
        branch, stack = [], [child]
        while stack:
            node = stack.pop()
            branch.append(node)
            stack.extend(node.children.values())
        if any(n.lock_ref for n in branch):
            return 0
        del head.node.children[self._edge_key(child.key)]
        return self._drop(branch)

    def reset(self) -> bool:
        """Drop every cached page (``/flush_cache``). Refused (False) while any lock is held."""
        nodes = list(self._nodes())
        if any(n.lock_ref for n in nodes):
            return False
        self.root.children.clear()
        self._drop(nodes, everything=True)
        return True

    def _drop(self, nodes: list[RadixNode], everything: bool = False) -> int:
        """Free the pages of ``nodes``, already unlinked from the tree and unlocked (``everything``:
        the whole tree, reported as cleared). Pages freed."""
        pages = [p for n in nodes for p in n.pages]
        self.allocator.free(pages)
        if self.events is not None:
            if everything:
                self.events.cleared()
            elif pages:
                self.events.removed(pages)
        for page in pages:
            self._owned[page] = 0
        for n in nodes:
            n.evicted = True
        self._total -= len(pages)
        return len(pages)

    # -- integrity --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``KVAccountingError`` unless the tree, the counters, the ownership map and the
        allocator agree: every cached page is allocated and cached once."""
        root, ps = self.root, self.page_size
        if root.key or root.pages or root.parent is not None or root.lock_ref:
            raise KVAccountingError("radix root must hold nothing and carry no lock")
        seen: set[int] = set()
        total = protected = 0
        for node in itertools.chain([root], self._nodes()):
            child_locks = 0
            for edge, child in node.children.items():
                if child.parent is not node or child.evicted:
                    raise KVAccountingError(f"radix node {child.id} has a stale parent link or is evicted")
                if not child.pages or len(child.key) != len(child.pages) * ps or self._edge_key(child.key) != edge:
                    raise KVAccountingError(f"radix node {child.id}: key/pages not page-aligned or misfiled")
                child_locks += child.lock_ref
            if node is not root and node.lock_ref < child_locks:
                raise KVAccountingError(f"radix node {node.id}: lock_ref {node.lock_ref} < children's {child_locks}")
            for page in node.pages:
                if page in seen or not self.allocator.is_allocated(page) or not self._owned[page]:
                    raise KVAccountingError(f"cached page {page}: duplicated, free in the allocator, or unmarked")
                seen.add(page)
            total += len(node.pages)
            protected += len(node.pages) if node.lock_ref > 0 else 0
        if total != self._total or protected != self._protected or sum(self._owned) != total:
            raise KVAccountingError(
                f"radix counters: total {self._total} (tree {total}), protected {self._protected} "
                f"(tree {protected}), ownership map {sum(self._owned)}"
            )

    # -- internals --------------------------------------------------------------------------

    def _edge_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self, key: list[int]) -> tuple[RadixNode, int, list[int]]:
        """Follow ``key`` (page-aligned) down the tree, splitting the edge where it diverges, and
        stamp the path with a new tick. Returns (last node, matched tokens, matched pages)."""
        self._clock += 1
        ps = self.page_size
        node, pos, pages = self.root, 0, []
        while pos < len(key):
            child = node.children.get(tuple(key[pos : pos + ps]))
            if child is None:
                break
            common = self._common_pages(child.key, key, pos)
            if common < len(child.pages):
                child = self._split(child, common)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return node, pos, pages

    def _common_pages(self, edge: list[int], key: list[int], pos: int) -> int:
        """Whole pages ``edge`` shares with ``key[pos:]`` (>= 1: the first page matched already)."""
        ps = self.page_size
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos : pos + n]:  # the common case: one C-level comparison
            return n // ps
        i = ps
        while i < n and edge[i : i + ps] == key[pos + i : pos + i + ps]:
            i += ps
        return i // ps

    def _split(self, child: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``child``'s edge after ``num_pages`` pages; a new node takes the head, ``child``
        keeps the tail (so handles to ``child`` still name the same path). Returns the head."""
        cut = num_pages * self.page_size
        parent = child.parent
        assert parent is not None and 0 < num_pages < len(child.pages)
        head = RadixNode(next(self._ids), child.key[:cut], child.pages[:num_pages], parent, child.last_access)
        head.lock_ref = child.lock_ref
        parent.children[self._edge_key(head.key)] = head
        child.key, child.pages, child.parent = child.key[cut:], child.pages[num_pages:], head
        head.children[self._edge_key(child.key)] = child
        return head

    def _check_held(self, pages: list[int]) -> None:
        for page in pages:
            if not self.allocator.is_allocated(page):
                raise KVAccountingError(f"page {page} handed to the radix cache is not allocated")
        if len(set(pages)) != len(pages):
            raise KVAccountingError(f"page listed twice: {pages}")

    def _check_row(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Validate a request's (tokens, pages); return its number of full pages."""
        num_full = len(token_ids) // self.page_size
        if len(pages) * self.page_size < len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens do not fit on {len(pages)} pages")
        if len(set(pages)) != len(pages):
            raise KVAccountingError(f"page listed twice: {list(pages)}")
        for page in pages[num_full:]:
            if self._owned[page] or not self.allocator.is_allocated(page):
                raise KVAccountingError(f"tail page {page} of a request is cached or free")
        return num_full
