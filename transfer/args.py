"""``KVArgs``: everything a manager registers and tells its peers, as ``BufferSet``s
(``transfer.buffers``: base pointers and item sizes, never tensors).

KV buffers come in transfer order (K of layer 0..L-1, then V of layer 0..L-1; see
``common.kvcache.pool.KVPool.buffers``); item j of every KV buffer is page j. State buffers (hybrid
models: one per convolution layer, ``common.kvcache.state_pool``) have slot j as item j.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.kvcache.pool import KVLayout, KVPool
from common.kvcache.state_pool import StateLayout, StatePool
from transfer.aux import aux_row_dtype
from transfer.buffers import BufferSet

__all__ = ["BufferSet", "KVArgs"]  # BufferSet is re-exported: callers import both from here


@dataclass(frozen=True)
class KVArgs:
    """Everything a manager registers with the data plane and tells its peers."""

    layout: KVLayout
    kv: BufferSet
    aux: BufferSet
    state: BufferSet = field(default_factory=BufferSet)
    state_layout: StateLayout | None = None  # what peers must agree on; None: no state buffers
    aux_top_k: int = 0  # top logprobs per aux row (see transfer.aux)
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    host: str = "127.0.0.1"  # address peers reach this rank's control and data planes on

    def __post_init__(self) -> None:
        if len(self.aux) and set(self.aux.item_nbytes) != {aux_row_dtype(self.aux_top_k).itemsize}:
            raise ValueError(f"aux rows of {self.aux.item_nbytes} bytes do not match aux_top_k={self.aux_top_k}")
        if len(self.kv) != 2 * self.layout.num_layers:
            raise ValueError(f"{len(self.kv)} KV buffers for {self.layout.num_layers} layers (want K and V per layer)")
        if len(self.state) != (0 if self.state_layout is None else self.state_layout.num_layers):
            raise ValueError(f"{len(self.state)} state buffers for state layout {self.state_layout}")

    @staticmethod
    def kv_from_pool(pool: KVPool) -> BufferSet:
        page = pool.layout.bytes_per_page_per_layer
        n = len(pool.buffers())
        return BufferSet(tuple(pool.buffer_ptrs()), tuple(pool.buffer_nbytes()), (page,) * n)

    @staticmethod
    def state_from_pool(pool: StatePool | None) -> BufferSet:
        if pool is None:
            return BufferSet()
        n = len(pool.buffers)
        return BufferSet(tuple(pool.buffer_ptrs()), tuple(pool.buffer_nbytes()), (pool.layout.item_nbytes,) * n)

    def all_buffers(self) -> list[tuple[int, int]]:
        """(ptr, nbytes) of every buffer to register with the data plane."""
        return [(p, n) for bs in (self.kv, self.aux, self.state) for p, n in zip(bs.ptrs, bs.nbytes)]
