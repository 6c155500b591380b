"""``KVArgs``: everything a manager registers and tells its peers, as ``BufferSet``s
(``transfer.buffers``: base pointers and item sizes, never tensors).

KV buffers come in transfer order (K of layer 0..L-1, then V of layer 0..L-1; see
``common.kvcache.pool.KVPool.buffers``); item j of every KV buffer is page j. State buffers (hybrid
models: one per convolution layer, ``common.kvcache.state_pool``) have slot j as item j.

Tensor parallelism: ``tp_rank``/``tp_size`` and ``total_kv_heads`` (the model's KV heads, given,
never back-computed) say which heads this rank's pool holds (``bootstrap_server.heads``). Between
unequal TP sizes a rank moves head slices, which are not contiguous in a token-major page, through
a staging buffer (``transfer.staging``): for that the manager needs the pool tensors themselves
(``kv_tensors``, the same buffers as ``kv``) and ``staging_pages`` of room. Equal TP never stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bootstrap_server.errors import LayoutMismatch
from bootstrap_server.heads import RankHeads, rank_heads
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
    # The model's KV heads. None: the pool's own count at tp_size 1; unknown above (the rank
    # then serves or receives only its own TP size: it cannot tell which heads a peer holds).
    total_kv_heads: int | None = None
    # The KV buffers as tensors (transfer order, the memory ``kv`` points at): staging gathers
    # from and scatters into them. Empty: this rank cannot stage (equal TP only).
    kv_tensors: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)
    # Staging room, in pages of this rank's KV (all layers, K and V): per transfer worker on a
    # prefill (a larger chunk goes in pieces), the shadow area rooms take pages from on a decode
    # (as many as the pool's pages never runs out). 0: no staging.
    staging_pages: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.total_kv_heads is None and self.tp_size == 1:
            object.__setattr__(self, "total_kv_heads", self.layout.num_kv_heads)
        heads = self.heads
        if heads is not None and heads.count != self.layout.num_kv_heads:
            raise ValueError(f"rank {self.tp_rank} of tp_size {self.tp_size} with {self.total_kv_heads} KV heads holds "
                             f"{heads.count}, but its pool has {self.layout.num_kv_heads}")
        if self.kv_tensors:
            if tuple(t.data_ptr() for t in self.kv_tensors) != self.kv.ptrs:
                raise ValueError("kv_tensors must be the tensors the KV buffers point at, in transfer order")
            lay = self.layout
            if any(not t.is_contiguous() or t.dim() != 3 or t.shape[0] % lay.page_size
                   or tuple(t.shape[1:]) != (lay.num_kv_heads, lay.head_dim) for t in self.kv_tensors):
                raise ValueError(f"kv_tensors must be contiguous [slots, {lay.num_kv_heads}, {lay.head_dim}] pool buffers")
        if self.staging_pages < 0:
            raise ValueError(f"staging_pages must be >= 0, got {self.staging_pages}")
        if len(self.aux) and set(self.aux.item_nbytes) != {aux_row_dtype(self.aux_top_k).itemsize}:
            raise ValueError(f"aux rows of {self.aux.item_nbytes} bytes do not match aux_top_k={self.aux_top_k}")
        if len(self.kv) != 2 * self.layout.num_layers:
            raise ValueError(f"{len(self.kv)} KV buffers for {self.layout.num_layers} layers (want K and V per layer)")
        if len(self.state) != (0 if self.state_layout is None else self.state_layout.num_layers):
            raise ValueError(f"{len(self.state)} state buffers for state layout {self.state_layout}")

    @property
    def heads(self) -> RankHeads | None:
        """The global KV heads this rank's pool holds (None: the model's count is unknown)."""
        if self.total_kv_heads is None:
            return None
        try:
            return rank_heads(self.tp_size, self.total_kv_heads, self.tp_rank)
        except LayoutMismatch as exc:
            raise ValueError(str(exc)) from None

    @property
    def can_stage(self) -> bool:
        """Whether this rank can move head slices (serve or receive another TP size)."""
        return bool(self.kv_tensors) and self.staging_pages > 0 and self.total_kv_heads is not None

    @property
    def page_unit_nbytes(self) -> int:
        """Bytes of one staging page: one KV page of this rank in every buffer."""
        return sum(self.kv.item_nbytes)

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
