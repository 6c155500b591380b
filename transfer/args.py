"""Plain-data descriptions of the memory a manager moves, and the layout check between peers.

A manager never sees tensors, only base pointers and sizes::

    BufferSet.ptrs[i]         base address of buffer i
    BufferSet.nbytes[i]       its total size
    BufferSet.item_nbytes[i]  size of one addressable item (a KV page, an aux row, a state slot)

    address of item j in buffer i = ptrs[i] + j * item_nbytes[i]

KV buffers come in transfer order (K of layer 0..L-1, then V of layer 0..L-1; see
``common.kvcache.pool.KVPool.buffers``); item j of every KV buffer is page j.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.kvcache.pool import KVLayout, KVPool


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


@dataclass(frozen=True)
class KVArgs:
    """Everything a manager registers with the data plane and tells its peers."""

    layout: KVLayout
    kv: BufferSet
    aux: BufferSet
    state: BufferSet = field(default_factory=BufferSet)
    aux_top_k: int = 0  # top logprobs per aux row (see transfer.aux)
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    host: str = "127.0.0.1"  # address peers reach this rank's control and data planes on

    def __post_init__(self) -> None:
        from transfer.aux import aux_row_dtype

        if len(self.aux) and set(self.aux.item_nbytes) != {aux_row_dtype(self.aux_top_k).itemsize}:
            raise ValueError(f"aux rows of {self.aux.item_nbytes} bytes do not match aux_top_k={self.aux_top_k}")
        if len(self.kv) != 2 * self.layout.num_layers:
            raise ValueError(f"{len(self.kv)} KV buffers for {self.layout.num_layers} layers (want K and V per layer)")

    @staticmethod
    def kv_from_pool(pool: KVPool) -> BufferSet:
        page = pool.layout.bytes_per_page_per_layer
        n = len(pool.buffers())
        return BufferSet(tuple(pool.buffer_ptrs()), tuple(pool.buffer_nbytes()), (page,) * n)

    def all_buffers(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of every buffer to register with the data plane."""
        return [(p, n) for bs in (self.kv, self.aux, self.state) for p, n in zip(bs.ptrs, bs.nbytes)]
