"""ReqToTokenPool: row lifecycle and table writes, against a model of held rows and row contents."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.kvcache.allocator import KVAccountingError
from common.kvcache.req_to_token import ReqToTokenPool


def test_rows_run_out_and_come_back() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]  # type: ignore[type-var]
    assert pool.alloc() is None and pool.num_free == 0
    pool.free(1)
    assert pool.alloc() == 1
    pool.check_integrity()


@pytest.mark.parametrize("bad", [-1, 3, 2], ids=["negative", "out-of-range", "double-free"])
def test_bad_free_is_loud(bad: int) -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.alloc() == 0 and pool.alloc() == 1
    with pytest.raises(KVAccountingError):
        pool.free(bad)
    assert pool.num_free == 1
    pool.check_integrity()


def test_write_and_read_back() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    row = pool.alloc()
    assert row is not None
    pool.write(row, 2, torch.tensor([40, 41, 42], dtype=torch.int64))
    pool.write(row, 0, [7, 8])
    assert pool.table.dtype == torch.int32 and pool.table.shape == (3, 8)  # 2 rows + the pad row
    assert pool.read(row, 5).tolist() == [7, 8, 40, 41, 42]
    assert pool.read(row, 4, start=3).tolist() == [41]
    assert pool.table[1 - row].tolist() == [0] * 8  # the other row is untouched
    assert pool.table[pool.pad_row].tolist() == [0] * 8


def test_the_pad_row_is_never_handed_out_nor_writable() -> None:
    pool = ReqToTokenPool(2, 4, "cpu")
    assert pool.pad_row == 2
    assert sorted(r for r in (pool.alloc(), pool.alloc()) if r is not None) == [0, 1]
    assert pool.alloc() is None
    with pytest.raises(KVAccountingError):
        pool.write(pool.pad_row, 0, [5])
    with pytest.raises(KVAccountingError):
        pool.free(pool.pad_row)
    assert pool.table[pool.pad_row].tolist() == [0] * 4


def test_bad_writes_are_rejected() -> None:
    pool = ReqToTokenPool(2, 4, "cpu")
    row = pool.alloc()
    assert row is not None
    with pytest.raises(ValueError):
        pool.write(row, 2, [1, 2, 3])  # past max_context_len
    with pytest.raises(ValueError):
        pool.write(row, -1, [1])
    with pytest.raises(KVAccountingError):
        pool.write(1 - row, 0, [1])  # row not allocated
    with pytest.raises(KVAccountingError):
        pool.read(1 - row, 1)
    assert pool.table.tolist() == [[0] * 4, [0] * 4, [0] * 4]  # two rows and the pad row


class ReqToTokenMachine(RuleBasedStateMachine):
    MAX_REQS, CONTEXT = 4, 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(self.MAX_REQS, self.CONTEXT, "cpu")
        self.rows: dict[int, list[int]] = {}  # held row -> expected contents (0 = never written)

    @rule()
    def alloc(self) -> None:
        row = self.pool.alloc()
        if len(self.rows) == self.MAX_REQS:
            assert row is None
            return
        assert row is not None and row not in self.rows and 0 <= row < self.MAX_REQS
        self.rows[row] = list(self.pool.table[row].tolist())  # stale contents are allowed

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        start = data.draw(st.integers(0, self.CONTEXT))
        slots = data.draw(st.lists(st.integers(0, 2**31 - 1), max_size=self.CONTEXT - start))
        self.pool.write(row, start, slots)
        self.rows[row][start : start + len(slots)] = slots

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.rows)))
        self.pool.free(row)
        del self.rows[row]
        with pytest.raises(KVAccountingError):
            self.pool.free(row)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_free == self.MAX_REQS - len(self.rows)
        for row, expected in self.rows.items():
            assert self.pool.read(row, self.CONTEXT).tolist() == expected


TestReqToTokenMachine = ReqToTokenMachine.TestCase
TestReqToTokenMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
