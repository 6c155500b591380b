"""Per-layer paged K/V tensors: the memory the prefill node writes and the decode node receives.

Layout (token-major, one K and one V tensor per layer)::

    k_buffers[layer]: [num_pages * page_size, num_kv_heads, head_dim]
    slot = page * page_size + offset_in_page

    page:      0 (reserved)   1               2
    slots:   [0 .. ps-1]   [ps .. 2ps-1]   [2ps .. 3ps-1] ...

Page 0 is never handed out: padded rows (CUDA graphs, dummy decode slots) write there, so a
garbage write can never land in a live request's page. A run of consecutive pages is one
contiguous byte range per layer and per K/V, which is what lets the transfer layer move a
request's KV with ``runs x layers x 2`` descriptors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

RESERVED_PAGES = 1


@dataclass(frozen=True)
class KVLayout:
    """What a peer must agree on to receive our pages (compared at bootstrap lookup)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # torch dtype name without the "torch." prefix

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K (or of V) one token occupies in one layer."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.bytes_per_token_per_layer * self.page_size


class KVPool:
    """Owns the K/V tensors. Allocation of pages is the ``PageAllocator``'s job, not this one's."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device) -> None:
        if num_pages <= RESERVED_PAGES:
            raise ValueError(f"KV pool needs more than {RESERVED_PAGES} page(s), got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = layout.page_size
        self.num_slots = num_pages * layout.page_size
        dtype = getattr(torch, layout.dtype)
        shape = (self.num_slots, layout.num_kv_heads, layout.head_dim)
        self.k_buffers: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.v_buffers: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slots: [T] int64; k, v: [T, kv_heads, head_dim]."""
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer in transfer order: K of layer 0..L-1, then V of layer 0..L-1."""
        return [*self.k_buffers, *self.v_buffers]

    def buffer_ptrs(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers()]

    def buffer_nbytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b in self.buffers()]

    def nbytes(self) -> int:
        return sum(self.buffer_nbytes())
