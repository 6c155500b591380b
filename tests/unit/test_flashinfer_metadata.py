"""The FlashInfer backend's page tables (CSR indptr / indices / last_page_len), built without a
device sync, against a per-request loop over the req->token table. Pure torch: runs on CPU."""
from __future__ import annotations

import random

import pytest
import torch

from common.attention.flashinfer_backend import paged_kv_metadata


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_tables_match_a_loop_over_rows(page_size: int) -> None:
    rng = random.Random(page_size)
    rows_n, ctx = 6, 96
    table = torch.zeros(rows_n + 1, ctx, dtype=torch.int32)
    free = list(range(1, rows_n * ctx + 10))
    rng.shuffle(free)
    for r in range(rows_n):  # each row: scattered pages, slots page * page_size + offset
        pages = [free.pop() for _ in range(ctx // page_size)]
        table[r] = torch.tensor([p * page_size + o for p in pages for o in range(page_size)], dtype=torch.int32)
    rows = [4, 0, 5, 2, rows_n]  # the last one is an all-zero (pad) row
    seq = [1, page_size, page_size + 1, 77, 1]
    indptr, indices, last = paged_kv_metadata(seq, torch.tensor(rows), table, page_size)
    want_indices, want_indptr, want_last = [], [0], []
    for r, s in zip(rows, seq):
        n = -(-s // page_size)
        want_indices += [int(table[r, j * page_size]) // page_size for j in range(n)]
        want_indptr.append(want_indptr[-1] + n)
        want_last.append(s - (n - 1) * page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == want_indptr
    assert indices.tolist() == want_indices
    assert last.tolist() == want_last
    assert indices[-1] == 0  # the pad row maps to the reserved page
