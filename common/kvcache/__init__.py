"""KV memory: paged K/V tensors, the page allocator, request rows and the radix prefix cache."""
from common.kvcache.allocator import (
    KVAccountingError,
    PageAllocator,
    contiguous_run_pairs,
    contiguous_runs,
    pages_to_slots,
)
from common.kvcache.pool import RESERVED_PAGES, KVLayout, KVPool
from common.kvcache.radix_cache import RadixCache
from common.kvcache.radix_node import MatchResult, RadixNode
from common.kvcache.req_to_token import ReqToTokenPool

__all__ = [
    "RESERVED_PAGES",
    "KVAccountingError",
    "KVLayout",
    "KVPool",
    "MatchResult",
    "PageAllocator",
    "RadixCache",
    "RadixNode",
    "ReqToTokenPool",
    "contiguous_run_pairs",
    "contiguous_runs",
    "pages_to_slots",
]
