"""The radix cache's tree node and match result (``radix_cache.py`` says how the tree is kept).

Callers hold a ``RadixNode`` only as a lock handle; ``MatchResult`` is what a prefix match gives.
"""
from __future__ import annotations

from dataclasses import dataclass


class RadixNode:
    """One tree edge: ``key`` tokens whose KV lives on ``pages``. Opaque to callers (a lock handle)."""

    __slots__ = ("id", "key", "pages", "parent", "children", "lock_ref", "last_access", "evicted")

    def __init__(self, node_id: int, key: list[int], pages: list[int], parent: RadixNode | None, tick: int) -> None:
        self.id = node_id
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0  # requests holding this node or a descendant
        self.last_access = tick
        self.evicted = False  # detached from the tree; using it as a lock handle is a bug


@dataclass(frozen=True)
class MatchResult:
    pages: list[int]  # cached pages of the matched prefix, in position order
    num_tokens: int  # == len(pages) * page_size
    node: RadixNode  # lock handle: the node ending the match (root when nothing matched)
