"""One narrow API over the three KV pools (request rows, pages, prefix cache) for schedulers.

A request's KV bookkeeping is a ``ReqKV``: its row in the req->token table and the pages that
back positions ``[0, len(pages) * page_size)`` in order. The first ``num_cached`` tokens came
from the prefix cache (read-only, pinned by a lock on ``node``); the rest are the request's own::

    positions  0 ........ num_cached ............... kv_len ...... capacity
    pages      [cached, locked][ own pages, written by forward ][ reserved ]

Hybrid models also give each request a recurrent-state slot (``state_pool.py``), taken in
``admit`` with the row and freed in ``release`` with it; ``row_state[row]`` maps a row to its slot
for the forward pass.

With ``digests`` (common/kvcache/page_digest.py) a cached prefix is trusted only while its pages
still hold what our forward wrote: ``admit`` checks the matched pages, drops the cached branch
from the first page that changed and matches again short of it (the request recomputes the
rest); ``written`` records the pages a forward completed; ``room_digest`` is what the decode
checks the arrived KV against.

Every path ends in exactly one ``release`` (finish, abort, failure); a second one is a bug and
raises. Capacity that a scheduler may plan with is ``available_pages()``: free pages plus
pages the cache could evict.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kvcache.allocator import KVAccountingError, PageAllocator, pages_to_slots
from common.kvcache.page_digest import PageDigests
from common.kvcache.radix_cache import RadixCache
from common.kvcache.radix_node import RadixNode
from common.kvcache.req_to_token import ReqToTokenPool
from common.kvcache.state_pool import StatePool

log = logging.getLogger(__name__)


@dataclass
class ReqKV:
    row: int
    node: RadixNode
    num_cached: int  # prompt tokens served from the prefix cache
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V is in the pool
    released: bool = False
    state_slot: int | None = None  # hybrid models only: the request's recurrent-state slot


class KVMemory:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool, cache: RadixCache, page_size: int,
                 states: StatePool | None = None, digests: PageDigests | None = None) -> None:
        if states is not None and cache.enabled:
            # A cached prefix has KV but no state for its last token: a hit would skip the state.
            raise ValueError("the prefix cache cannot serve a model with recurrent state")
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.cache = cache
        self.page_size = page_size
        self.states = states
        self.digests = digests
        # [R+1]: the pad row (ReqToTokenPool.pad_row) maps to the reserved state slot 0 forever.
        self.row_state = torch.zeros(req_to_token.max_reqs + 1, dtype=torch.int64, device=req_to_token.device)  # [R+1]

    # -- capacity ---------------------------------------------------------------------------

    def available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_pages()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- lifecycle --------------------------------------------------------------------------

    def can_admit(self) -> bool:
        """Whether ``admit`` would find a row (and a state slot, for hybrid models)."""
        return self.req_to_token.num_free > 0 and (self.states is None or self.states.num_free > 0)

    def admit(self, token_ids: Sequence[int], use_cache: bool = True) -> ReqKV | None:
        """Take a request row (and a zeroed state slot, for hybrid models) and the longest cached
        prefix of ``token_ids`` (leaving at least one token to compute). None when no row or no
        state slot is free."""
        if not self.can_admit():
            return None
        row = self.req_to_token.alloc()
        assert row is not None
        slot = None
        if self.states is not None:
            slot = self.states.alloc()
            assert slot is not None
            self.row_state[row] = slot
        if use_cache:
            match = self.cache.match_prefix(token_ids, max_tokens=len(token_ids) - 1)
            bad = None if self.digests is None else self.digests.first_mismatch(match.pages)
            if bad is not None:
                # A cached page no longer holds what our forward wrote (a write through the data
                # plane): never serve it. Its branch goes; the request recomputes from there.
                self.digests.failures += 1
                log.warning("prefix cache: page %d (position %d) changed after it was cached; dropping its "
                            "branch and recomputing", match.pages[bad], bad * self.page_size)
                self.cache.discard_after(token_ids, bad)
                match = self.cache.match_prefix(token_ids, max_tokens=min(len(token_ids) - 1, bad * self.page_size))
        else:
            match = self.cache.match_prefix([], max_tokens=0)
        self.cache.inc_lock(match.node)
        req = ReqKV(row=row, node=match.node, num_cached=match.num_tokens, pages=list(match.pages),
                    kv_len=match.num_tokens, state_slot=slot)
        if match.pages:
            self._write_row(req, 0, match.pages)
        return req

    def reserve(self, req: ReqKV, num_tokens: int) -> bool:
        """Make positions ``[0, num_tokens)`` backed by pages; evict cache if needed.
        All-or-nothing: False (and nothing changed) when memory does not fit."""
        self._check_live(req)
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if num_tokens > self.req_to_token.max_context_len:
            return False
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        new = self.allocator.alloc(need)
        if new is None:
            return False
        start_page = len(req.pages)
        req.pages.extend(new)
        self._write_row(req, start_page, new)
        return True

    def written(self, req: ReqKV, start: int, end: int, final: bool) -> None:
        """A forward wrote positions ``[start, end)``: record the digests of the pages it completed
        (with ``final``, the partly filled last page too). A no-op without digests."""
        if self.digests is None or end <= start:
            return
        ps = self.page_size
        first, full = start // ps, end // ps
        pages = req.pages[first:full]
        if pages:
            self.digests.record(pages)
        if final and end % ps:
            self.digests.record([req.pages[full]], valid_last=end % ps)

    def room_digest(self, req: ReqKV, num_tokens: int, start: int = 0) -> bytes:
        """The digest of the request's KV of tokens ``[start, num_tokens)`` (``start`` a whole
        number of pages: what a decode holding the first ``start`` tokens receives; b"" without
        digests)."""
        if self.digests is None:
            return b""
        return self.digests.room_digest(req.pages[start // self.page_size :], num_tokens - start)

    def arrived_intact(self, req: ReqKV, num_tokens: int, expected: bytes, start: int = 0) -> bool:
        """Whether the KV that arrived for tokens ``[start, num_tokens)`` (``start`` page
        aligned: the decode held the rest) is what the prefill digested (True without digests
        here). When it is, the full pages that arrived keep their digests: a prefix cache
        checks them again before reusing them (``admit``)."""
        if self.digests is None:
            return True
        pages = req.pages[start // self.page_size :]
        return self.digests.arrived_intact(pages, num_tokens - start, expected, record=self.cache.enabled)

    def slots(self, req: ReqKV, start: int, end: int) -> torch.Tensor:
        """KV slots of positions [start, end). [end-start] int64."""
        return self.req_to_token.read(req.row, end, start).long()

    def release(self, req: ReqKV, token_ids: Sequence[int] | None) -> None:
        """Give everything back exactly once. With ``token_ids`` (the tokens whose KV is in the
        pool, ``len == kv_len``) the full pages go to the prefix cache; without, they are freed."""
        self._check_live(req)
        if token_ids is not None and len(token_ids) < req.kv_len:
            raise ValueError(f"release with {len(token_ids)} tokens for kv_len {req.kv_len}")
        req.released = True
        used = self.pages_for(req.kv_len)
        self.allocator.free(req.pages[used:])  # reserved, never written
        if token_ids is not None:
            # Full pages join the cache (cached prefix pages are recognised as the same pages);
            # the partially filled tail page is freed; the prefix lock is dropped.
            self.cache.cache_finished(list(token_ids[: req.kv_len]), req.pages[:used], req.node)
        else:
            self.allocator.free(req.pages[req.num_cached // self.page_size : used])
            self.cache.dec_lock(req.node)
        if req.state_slot is not None and self.states is not None:
            self.states.free(req.state_slot)
        self.req_to_token.free(req.row)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.req_to_token.check_integrity()
        self.cache.check_integrity()
        if self.states is not None:
            self.states.check_integrity()

    def stats(self) -> dict[str, int]:
        states = {} if self.states is None else {
            "total_state_slots": self.states.max_slots, "free_state_slots": self.states.num_free}
        return states | {
            "page_size": self.page_size,
            "total_pages": self.allocator.num_total,
            "free_pages": self.allocator.num_free,
            "cached_pages": self.cache.total_pages(),
            "evictable_pages": self.cache.evictable_pages(),
            "locked_pages": self.cache.protected_pages(),
            "used_pages": self.allocator.num_total - self.allocator.num_free - self.cache.total_pages(),
            "total_req_slots": self.req_to_token.max_reqs,
            "free_req_slots": self.req_to_token.num_free,
        } | ({} if self.digests is None else {"kv_integrity_failures": self.digests.failures})

    # -- internals ----------------------------------------------------------------------------

    def _write_row(self, req: ReqKV, start_page: int, pages: Sequence[int]) -> None:
        slots = pages_to_slots(pages, self.page_size, len(pages) * self.page_size)
        self.req_to_token.write(req.row, start_page * self.page_size, slots)

    @staticmethod
    def _check_live(req: ReqKV) -> None:
        if req.released:
            raise KVAccountingError(f"request row {req.row} released twice")
