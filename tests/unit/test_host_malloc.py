"""common/host_malloc.py: both mallopt settings or none, and PDC_MALLOC_TUNING=0 sets nothing.

The settings themselves are checked in a child process (they are process-wide and mallopt cannot
read them back) through the program break: after forward-sized blocks at the top of the heap are
freed, a tuned process keeps the break where it was, an untuned one moves it down (glibc trims)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common import host_malloc

CHILD = r"""
import ctypes, sys
from common import host_malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_long]
tuned = host_malloc.tune(sys.argv[1] == "1")
# Three 8 MiB blocks: the first freed mmap chunk lifts glibc's dynamic threshold, so the next two
# come from the heap, untuned too; freeing them leaves 16 MiB free at the heap's top.
first = libc.malloc(8 << 20); libc.free(first)
blocks = [libc.malloc(8 << 20) for _ in range(2)]
top = libc.sbrk(0)
for b in reversed(blocks):
    libc.free(b)
print(tuned is not None, libc.sbrk(0) == top)
"""


def _child(enabled: bool) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if enabled else "0"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0], out[1]


@pytest.mark.skipif(host_malloc._glibc() is None, reason="glibc only")
def test_tuned_process_keeps_the_freed_heap_top() -> None:
    assert _child(True) == ("True", "True")  # set, and the heap was not trimmed


@pytest.mark.skipif(host_malloc._glibc() is None, reason="glibc only")
def test_untuned_process_gives_the_heap_top_back() -> None:
    # The reference behaviour the tuning exists to avoid: glibc trims the freed top.
    assert _child(False) == ("False", "False")


def test_off_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class FakeLibc:
        def mallopt(self, *args: object) -> int:
            calls.append(args)
            return 1

    monkeypatch.setattr(host_malloc, "_glibc", lambda: FakeLibc())
    monkeypatch.setenv("PDC_MALLOC_TUNING", "0")
    assert host_malloc.tune() is None and calls == []
    monkeypatch.setenv("PDC_MALLOC_TUNING", "1")
    assert host_malloc.tune() == {"M_MMAP_THRESHOLD": 32 << 20, "M_TRIM_THRESHOLD": 1 << 30}
    assert [c[0].value for c in calls] == [host_malloc.M_MMAP_THRESHOLD, host_malloc.M_TRIM_THRESHOLD]


def test_a_refused_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing:
        def mallopt(self, *args: object) -> int:
            return 0

    monkeypatch.setattr(host_malloc, "_glibc", lambda: Refusing())
    assert host_malloc.tune(True) is None
