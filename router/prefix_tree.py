"""A bounded radix tree of recent prompts (characters), remembering which worker saw each prefix.

The cache-aware policy asks ``match(text)``: for each worker, how many leading characters of
``text`` it has seen in a prompt before, which approximates how much of the prompt that prefill
node's radix cache still holds (the router has no tokenizer). ``insert(text, worker)`` records a
routed prompt. Memory is bounded by ``max_chars`` (edge characters in the tree): past it, the
least recently used leaves go first, down to 90 % of the bound, so eviction runs rarely.

    root --"You are a helpful"--> n1 {w0: t5, w1: t9}
                                   |--" assistant. Q1"--> n2 {w0: t5}
                                   `--" bot. Q2"--------> n3 {w1: t9}
"""
from __future__ import annotations

import itertools


class _Node:
    __slots__ = ("edge", "children", "workers", "parent", "last")

    def __init__(self, edge: str, parent: _Node | None) -> None:
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.workers: dict[str, int] = {}  # worker -> tick it last routed a prompt through here
        self.parent = parent
        self.last = 0  # tick of the last prompt through here, any worker


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be >= 1")
        self.max_chars = max_chars
        self.chars = 0
        self._root = _Node("", None)
        self._tick = itertools.count(1)

    def match(self, text: str) -> dict[str, int]:
        """worker -> characters of ``text`` it has seen as a prompt prefix (absent: none)."""
        out: dict[str, int] = {}
        node, depth = self._root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                break
            k = _common(child.edge, text[depth:])
            for w in child.workers:
                out[w] = depth + k
            if k < len(child.edge):
                break
            node, depth = child, depth + k
        return out

    def insert(self, text: str, worker: str) -> None:
        tick = next(self._tick)
        node, depth = self._root, 0
        while depth < len(text):
            child = node.children.get(text[depth])
            if child is None:
                leaf = _Node(text[depth:], node)
                node.children[text[depth]] = leaf
                self.chars += len(leaf.edge)
                node = leaf
                depth = len(text)
            else:
                k = _common(child.edge, text[depth:])
                if k < len(child.edge):  # split the edge: child keeps its tail under a new middle node
                    mid = _Node(child.edge[:k], node)
                    mid.workers, mid.last = dict(child.workers), child.last
                    node.children[text[depth]] = mid
                    child.edge, child.parent = child.edge[k:], mid
                    mid.children[child.edge[0]] = child
                    child = mid
                node, depth = child, depth + k
            node.workers[worker] = tick
            node.last = tick
        if self.chars > self.max_chars:
            self._evict(int(self.max_chars * 0.9))

    def remove_worker(self, worker: str) -> None:
        """Forget a worker everywhere (it left the cluster); prune what nobody holds."""
        for node in list(self._nodes()):
            node.workers.pop(worker, None)
            if not node.workers and not node.children:
                self._drop_leaf(node)

    def _nodes(self):  # type: ignore[no-untyped-def]
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _drop_leaf(self, node: _Node) -> None:
        parent = node.parent
        if parent is None or parent.children.get(node.edge[:1]) is not node:
            return
        del parent.children[node.edge[0]]
        self.chars -= len(node.edge)
        if parent is not self._root and not parent.children and not parent.workers:
            self._drop_leaf(parent)

    def _evict(self, target: int) -> None:
        leaves = sorted((n for n in self._nodes() if not n.children), key=lambda n: n.last)
        for leaf in leaves:
            if self.chars <= target:
                break
            node: _Node | None = leaf
            while node is not None and node is not self._root and not node.children:
                parent = node.parent
                self._drop_leaf(node)
                node = parent if parent is not None and parent.last <= leaf.last else None
