"""CPU tensors from fresh anonymous mappings: zero without being written, in 2-MiB pages for the
large buffers a decode step streams every step (the packed weights), in small pages for the ones
written sparsely (the decode mirror's lanes).

Why: a decode step of SmolLM2's shape reads 425 MB of packed weights; in 4-KiB pages that is
~100k TLB entries a step, and the page walks cost bandwidth. Our projection kernel read 30 layers'
weights at 8 rows at 33-36 GB/s from 4-KiB pages and at 37-40 GB/s from 2-MiB pages on the same
Zen 5 machine (38-39 GB/s is its read bandwidth; docs/BENCHMARKS.md "Weights in 2-MiB pages").

How: an anonymous private mapping, its start rounded up to 2 MiB, advised MADV_HUGEPAGE (which
works where transparent huge pages are ``always`` or ``madvise``, the common default). torch's
own allocator does this only when THP_MEM_ALLOC_ENABLE is set before its first allocation, which
a library cannot arrange. Where the advice is refused the buffer is still a correct tensor in
small pages. A small-page buffer is advised MADV_NOHUGEPAGE instead, so that where THP is
``always`` a first touch still maps 4 KiB, not 2 MiB. The tensor holds the mapping; it is unmapped
when the last view goes.
"""
from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32, huge: bool = True) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor. The zeros come from the kernel, page by page as they
    are first touched (fresh anonymous memory is zero), so a large buffer costs nothing until it is
    written, and only the pages written take memory. ``huge``: from 2 MiB up the data starts on a
    2-MiB boundary, advised into huge pages (what a buffer streamed whole every step wants: the
    packed weights). ``huge=False``: small pages, for a buffer written sparsely (the decode mirror,
    whose lanes fill a few hundred of their thousands of positions): ``torch.zeros`` of the mirror's
    778 MB took 1.6 s on a KVM guest (AMD EPYC Zen 4), a stall of every stream, to write 94 MB."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(tuple(shape), dtype=dtype)
    area = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = 0
    if huge:
        view = ctypes.c_char.from_buffer(area)
        start = (-ctypes.addressof(view)) % HUGE_PAGE
        del view  # an exported buffer would pin the mapping past the tensor's life
    # Advice refused (no THP in this kernel): the same tensor in the kernel's default pages.
    _advise(area, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", start, nbytes)
    flat = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start)
    return flat.view(dtype).view(tuple(shape))


def _advise(area: mmap.mmap, name: str, start: int, length: int) -> None:
    advice = getattr(mmap, name, None)
    if advice is not None:
        try:
            area.madvise(advice, start, length)
        except OSError:
            pass
