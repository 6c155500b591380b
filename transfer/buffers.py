"""``BufferSet``: the plain-data description of registered memory a manager moves.

A manager never sees tensors, only base pointers and sizes::

    BufferSet.ptrs[i]         base address of buffer i
    BufferSet.nbytes[i]       its total size
    BufferSet.item_nbytes[i]  size of one addressable item (a KV page, an aux row, a state slot)

    address of item j in buffer i = ptrs[i] + j * item_nbytes[i]

Its own module so ``transfer.args`` (which checks aux rows against ``transfer.aux``) and
``transfer.aux`` (whose pool describes itself as a BufferSet) need not import each other.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BufferSet:
    ptrs: tuple[int, ...] = ()
    nbytes: tuple[int, ...] = ()
    item_nbytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.ptrs) == len(self.nbytes) == len(self.item_nbytes):
            raise ValueError("BufferSet: ptrs, nbytes and item_nbytes must have one entry per buffer")
        if any(n <= 0 for n in self.item_nbytes) or any(b % i for b, i in zip(self.nbytes, self.item_nbytes)):
            raise ValueError("BufferSet: every buffer must hold a whole number of non-empty items")

    def __len__(self) -> int:
        return len(self.ptrs)

    def num_items(self) -> int:
        """Items every buffer can address (the smallest buffer bounds them all)."""
        return min((b // i for b, i in zip(self.nbytes, self.item_nbytes)), default=0)
