"""Per-request recurrent state of hybrid models: fixed-size slots, one per live request.

A hybrid model (LFM2: gated short convolutions mixed with attention) keeps, for each request and
each of its convolution layers, the last ``kernel`` inputs of that layer's convolution. Unlike KV
it does not grow with the sequence, so it lives in slots, not pages::

    buffers[conv_layer]: [num_slots, hidden, kernel]     (HF's conv cache, per request)
    slot 0 reserved (padding rows write there, as page 0 for KV); slots 1.. handed out

A slot is taken with the request's row and given back with it (``KVMemory``), so the same
exactly-once release covers it. ``alloc`` zeroes the slot: a request starts from zero state,
which is what a causal convolution's zero left padding means. A slot is read and rewritten in
place by every forward of its request (chunked prefill carries it from chunk to chunk), and on
the decode node it is written once by the prefill's transfer, after its last chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kvcache.allocator import KVAccountingError

RESERVED_STATE_SLOTS = 1


@dataclass(frozen=True)
class StateLayout:
    """What a peer must agree on to receive our states (compared at bootstrap lookup)."""

    num_layers: int  # conv layers, in model order
    shape: tuple[int, ...]  # one request's state in one layer, e.g. (hidden, kernel)
    dtype: str

    @property
    def item_nbytes(self) -> int:
        n = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        for d in self.shape:
            n *= d
        return n


class StatePool:
    def __init__(self, layout: StateLayout, num_slots: int, device: str | torch.device) -> None:
        """``num_slots`` usable slots (the reserved one comes on top)."""
        if num_slots < 1:
            raise ValueError(f"StatePool needs at least one slot, got {num_slots}")
        self.layout = layout
        self.max_slots = num_slots
        total = num_slots + RESERVED_STATE_SLOTS
        dtype = getattr(torch, layout.dtype)
        self.buffers: list[torch.Tensor] = [
            torch.zeros((total, *layout.shape), dtype=dtype, device=device) for _ in range(layout.num_layers)
        ]
        self._free: list[int] = list(range(total - 1, RESERVED_STATE_SLOTS - 1, -1))  # pops slot 1 first
        self._is_free = bytearray(b"\x01" * total)
        self._is_free[:RESERVED_STATE_SLOTS] = b"\x00" * RESERVED_STATE_SLOTS

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed slot, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        for buf in self.buffers:
            buf[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if not isinstance(slot, int) or not RESERVED_STATE_SLOTS <= slot < len(self._is_free):
            raise KVAccountingError(f"free of state slot {slot!r}: not a usable slot")
        if self._is_free[slot]:
            raise KVAccountingError(f"double free of state slot {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVAccountingError("free state slot list holds a slot twice")
        marked = {s for s in range(len(self._is_free)) if self._is_free[s]}
        if marked != free:
            raise KVAccountingError(f"state free map and free list disagree on {sorted(marked ^ free)[:16]}")

    # -- what the transfer layer registers: one buffer per conv layer, item j = slot j ----------

    def buffer_ptrs(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers]

    def buffer_nbytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b in self.buffers]

    def nbytes(self) -> int:
        return sum(self.buffer_nbytes())
