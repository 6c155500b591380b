"""Request rows: each running request owns one row of a [max_reqs, max_context_len] slot table.

``table[row, pos]`` is the KV slot (``page * page_size + offset``, see ``pool.py``) that holds
the K/V of token position ``pos`` of the request that owns ``row``::

    row 3:  pos   0    1    2    3  |  4    5   ...
            slot  28   29   30   31 |  12   13        (pages [7, 3], page_size 4)

Attention backends read ``table[row, :seq_len]``. Rows are not cleared on free: a reader only
ever looks at ``[:seq_len]`` of a row it owns, which the owner wrote first, and clearing a row
on every finish would cost a device write for nothing.

One more row, ``pad_row`` (index ``max_reqs``), is never handed out and stays all zeros: a padded
entry of a CUDA-graph decode batch points there, so its one position maps to slot 0 of the
reserved page 0 (``pool.py``) and its K/V write and attention never touch a live request.

A free of a row that is not allocated raises ``KVAccountingError``: it is always a bug.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from common.kvcache.allocator import KVAccountingError


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device) -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs max_reqs, max_context_len >= 1, got {max_reqs}, {max_context_len}")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.pad_row = max_reqs  # the extra, never-allocated row (module docstring)
        self.table = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int32, device=self.device)  # [R+1, C] int32
        # Popped from the end, so row 0 goes first; order is otherwise irrelevant.
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * max_reqs)
        # How often each row was allocated: tells a row's new owner from its last one (for caches
        # keyed by row that outlive a request, like the torch backend's decode mirror).
        self.epoch: list[int] = [0] * max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    @property
    def num_used(self) -> int:
        return self.max_reqs - len(self._free_rows)

    def is_allocated(self, row: int) -> bool:
        return 0 <= row < self.max_reqs and not self._is_free[row]

    def alloc(self) -> int | None:
        """A free row index, or ``None`` when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = 0
        self.epoch[row] += 1
        return row

    def free(self, row: int) -> None:
        """Release a row. Raises ``KVAccountingError`` if it is not allocated."""
        if not isinstance(row, int) or not 0 <= row < self.max_reqs:
            raise KVAccountingError(f"free of request row {row!r}: not a row (0..{self.max_reqs - 1})")
        if self._is_free[row]:
            raise KVAccountingError(f"double free of request row {row}")
        self._is_free[row] = 1
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor | Sequence[int]) -> None:
        """Set ``table[row, start : start + len(slots)] = slots`` on an allocated row."""
        if not self.is_allocated(row):
            raise KVAccountingError(f"write to request row {row}, which is not allocated")
        slots_t = torch.as_tensor(slots).to(device=self.device, dtype=torch.int32)  # [n] int32
        if slots_t.dim() != 1:
            raise ValueError(f"slots must be 1-D, got shape {tuple(slots_t.shape)}")
        end = start + slots_t.shape[0]
        if start < 0 or end > self.max_context_len:
            raise ValueError(f"positions [{start}, {end}) do not fit in max_context_len {self.max_context_len}")
        self.table[row, start:end] = slots_t

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """``table[row, start:end]`` (a view) of an allocated row. [end - start] int32."""
        if not self.is_allocated(row):
            raise KVAccountingError(f"read of request row {row}, which is not allocated")
        if not 0 <= start <= end <= self.max_context_len:
            raise ValueError(f"positions [{start}, {end}) out of range for max_context_len {self.max_context_len}")
        return self.table[row, start:end]

    def check_integrity(self) -> None:
        """Free rows are distinct, in range and agree with the free map."""
        free_set = set(self._free_rows)
        if len(free_set) != len(self._free_rows):
            raise KVAccountingError("free row list holds a row twice")
        marked = {r for r in range(self.max_reqs) if self._is_free[r]}
        if marked != free_set:
            raise KVAccountingError(f"free map and free row list disagree on {sorted(marked ^ free_set)[:16]}")
