"""Turn (source item, destination item) pairs into the fewest byte-range descriptors.

A run is a stretch where both the source and the destination index advance by one::

    src pages  3 4 5 9 10 11 12      dst pages 7 8 9 2 3 4 8
               `---'  `---'  |                 `---' `--' |
    runs       (3->7, 3)  (9->2, 3)  (12->8, 1)

Each run is one contiguous byte range in every buffer, so a chunk costs
``runs x buffers`` descriptors (``runs x layers x 2`` for K and V) instead of
``pages x buffers``. Per-descriptor cost dominates over TCP, hence the merge.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Descriptors:
    """Parallel lists, the shape ``batch_transfer_sync_write`` takes."""

    src: list[int]
    dst: list[int]
    lens: list[int]

    def __len__(self) -> int:
        return len(self.src)

    def __add__(self, other: Descriptors) -> Descriptors:
        return Descriptors(self.src + other.src, self.dst + other.dst, self.lens + other.lens)


EMPTY = Descriptors([], [], [])


def concat(parts: Sequence[Descriptors]) -> Descriptors:
    """One list of descriptors from several (one engine call for all of them)."""
    if len(parts) == 1:
        return parts[0]
    return Descriptors([x for p in parts for x in p.src], [x for p in parts for x in p.dst],
                       [x for p in parts for x in p.lens])


def index_list(indices: Sequence[int] | np.ndarray) -> list[int]:
    """Page/slot ids as plain ints, from a list, a numpy array or a CPU tensor."""
    return np.asarray(indices, dtype=np.int64).reshape(-1).tolist()


def merge_runs(src_idx: Sequence[int], dst_idx: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_start, dst_start, length) of each maximal run where both indices step by +1."""
    src = np.asarray(src_idx, dtype=np.int64)  # [n]
    dst = np.asarray(dst_idx, dtype=np.int64)  # [n]
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source items vs {dst.size} destination items")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)  # [n-1]: True where a new run starts at i+1
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))  # [runs]
    lengths = np.diff(np.concatenate((starts, [src.size])))  # [runs]
    return src[starts], dst[starts], lengths


def build(
    src_idx: Sequence[int],
    dst_idx: Sequence[int],
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_nbytes: Sequence[int],
) -> Descriptors:
    """Descriptors copying items ``src_idx[k] -> dst_idx[k]`` in every buffer, buffer-major."""
    s0, d0, n = merge_runs(src_idx, dst_idx)
    if n.size == 0:
        return EMPTY
    item = np.asarray(item_nbytes, dtype=np.int64)[:, None]  # [buffers, 1]
    src = np.asarray(src_ptrs, dtype=np.int64)[:, None] + s0[None, :] * item  # [buffers, runs]
    dst = np.asarray(dst_ptrs, dtype=np.int64)[:, None] + d0[None, :] * item  # [buffers, runs]
    lens = n[None, :] * item  # [buffers, runs]
    return Descriptors(src.ravel().tolist(), dst.ravel().tolist(), lens.ravel().tolist())


def split(desc: Descriptors, max_entries: int) -> Iterator[Descriptors]:
    """Batches of at most ``max_entries`` descriptors (engines reject larger per-peer batches)."""
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got {max_entries}")
    for i in range(0, len(desc), max_entries):
        j = i + max_entries
        yield Descriptors(desc.src[i:j], desc.dst[i:j], desc.lens[i:j])
