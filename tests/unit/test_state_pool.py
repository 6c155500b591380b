"""Recurrent-state slots (hybrid models): taken with a request row, freed with it exactly once,
zeroed on reuse, and counted by the memory report and the integrity check."""
from __future__ import annotations

import pytest
import torch

from common.kvcache.allocator import KVAccountingError, PageAllocator
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from common.kvcache.state_pool import StateLayout, StatePool

LAYOUT = StateLayout(num_layers=3, shape=(8, 3), dtype="float32")


def memory(rows: int = 4, slots: int = 4) -> KVMemory:
    alloc = PageAllocator(32)
    return KVMemory(alloc, ReqToTokenPool(rows, 64, "cpu"), RadixCache(alloc, 4, enabled=False), 4,
                    StatePool(LAYOUT, slots, "cpu"))


def test_layout_bytes_and_buffers() -> None:
    pool = StatePool(LAYOUT, 5, "cpu")
    assert LAYOUT.item_nbytes == 8 * 3 * 4
    assert [tuple(b.shape) for b in pool.buffers] == [(6, 8, 3)] * 3  # slot 0 reserved on top
    assert pool.buffer_nbytes() == [6 * LAYOUT.item_nbytes] * 3 and pool.num_free == 5


def test_slots_are_zeroed_on_reuse_and_never_the_reserved_one() -> None:
    pool = StatePool(LAYOUT, 2, "cpu")
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {1, 2} and pool.alloc() is None
    for buf in pool.buffers:
        buf[a].fill_(7.0)
    pool.free(a)
    again = pool.alloc()
    assert again == a and all(torch.count_nonzero(buf[a]) == 0 for buf in pool.buffers)


@pytest.mark.parametrize("bad", [0, 3, -1, "1"])
def test_free_of_a_slot_not_handed_out_raises(bad: object) -> None:
    pool = StatePool(LAYOUT, 2, "cpu")
    with pytest.raises(KVAccountingError):
        pool.free(bad)  # type: ignore[arg-type]


def test_double_free_raises_and_integrity_holds() -> None:
    pool = StatePool(LAYOUT, 2, "cpu")
    s = pool.alloc()
    assert s is not None
    pool.free(s)
    with pytest.raises(KVAccountingError, match="double free"):
        pool.free(s)
    pool.check_integrity()


def test_memory_takes_and_frees_a_slot_with_the_row() -> None:
    mem = memory()
    kv = mem.admit([1, 2, 3])
    assert kv is not None and kv.state_slot is not None
    assert int(mem.row_state[kv.row]) == kv.state_slot
    assert mem.stats()["free_state_slots"] == 3 and mem.stats()["total_state_slots"] == 4
    assert mem.reserve(kv, 3)
    mem.release(kv, None)
    assert mem.stats()["free_state_slots"] == 4 and mem.stats()["free_req_slots"] == 4
    with pytest.raises(KVAccountingError):
        mem.release(kv, None)  # the row and the slot go back exactly once
    mem.check_integrity()


def test_no_free_slot_means_no_admission_and_nothing_taken() -> None:
    mem = memory(rows=4, slots=1)
    first = mem.admit([1])
    assert first is not None and not mem.can_admit()
    assert mem.admit([2]) is None
    assert mem.stats()["free_req_slots"] == 3, "a refused admission must not keep a row"
    mem.release(first, [1])
    assert mem.can_admit()


def test_a_prefix_cache_cannot_serve_a_stateful_model() -> None:
    alloc = PageAllocator(8)
    with pytest.raises(ValueError, match="prefix cache"):
        KVMemory(alloc, ReqToTokenPool(2, 16, "cpu"), RadixCache(alloc, 4), 4, StatePool(LAYOUT, 2, "cpu"))
