"""glibc's malloc in a scheduler process: keep the memory a forward frees for the next forward.

Why. A forward allocates its activations and frees them a few ops later: on SmolLM2-135M's shape
a 2048-token chunk allocates [2048, 576] hidden states (4.7 MB) and a [2048, 3072] gate/up
product (25 MB) in each of 30 layers. glibc serves such blocks from mmap at first, then (its
dynamic threshold) from the heap, and gives the top of the heap back to the kernel whenever more
than twice that threshold is free there. Given back, the next forward's first touch faults every
4 KiB page in again and the kernel zeroes it: a single RMSNorm over 512 rows measured 90 us in
one loop and 885 us in another, the difference being page faults.

What. Two settings, once, before the model loads (``tune``):
- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): blocks under it come from the heap;
- ``M_TRIM_THRESHOLD`` 1 GiB: the heap keeps what was freed instead of returning it.
Both or neither: a ``mallopt`` of either turns off glibc's dynamic adjustment of both, and the
other stays at its 128 KiB default. Measured alone (one thread, SmolLM2's shape), the trim
threshold took a 512-token prefill from 692 to 1162 ms (every block above 128 KiB a fresh mmap),
the mmap threshold to 862 ms (the heap trimmed after every forward).

Measured with both (``python -m common.tools.bench_decode_step``, alternated runs, docs/BENCHMARKS.md):
prefill of 2048 tokens 3.85-3.89 s against 4.40-4.60 s, of 512 tokens 631-652 ms against
644-679 ms; decode steps unchanged (their blocks are small).

Cost: the process keeps its largest forward's activations mapped between forwards (tens of MB
for a 2048-token chunk of a small model), as jemalloc or tcmalloc would. Not glibc (musl): nothing
is set; under an allocator preloaded with ``LD_PRELOAD`` glibc's settings are made and have no
effect. ``PDC_MALLOC_TUNING=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 1 << 30  # mallopt takes an int


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it; a preloaded allocator leaves mallopt inert
        return libc
    except (OSError, AttributeError):
        return None


def tune(enabled: bool | None = None) -> dict[str, int] | None:
    """Apply the settings above (``enabled`` None: unless ``PDC_MALLOC_TUNING=0``); what was set,
    or None: off, not glibc, or a setting refused (then logged; one refused after the other was
    set leaves that one alone in force, which glibc's limits on these values never cause). The
    scheduler process calls it through ``common.cpu_budget.apply_scheduler_budget``; the bench
    tools that time forwards call it too, so they measure what a node runs."""
    if enabled is None:
        from common import envs

        enabled = envs.MALLOC_TUNING.get()
    if not enabled:
        return None
    libc = _glibc()
    if libc is None:
        log.info("malloc tuning skipped: this process's C library is not glibc")
        return None
    settings = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, MMAP_THRESHOLD), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD)}
    for name, (param, value) in settings.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("mallopt(%s, %d) refused: forwards may fault their activations in each time", name, value)
            return None
    return {name: value for name, (_, value) in settings.items()}
