"""The TP group's collectives across two real processes (gloo over loopback), bounded in time."""
from __future__ import annotations

from typing import Any

import torch

from tests.tp_harness import run_ranks


def _rank(rank: int, port: int, out: Any) -> None:
    from common.parallel import init_tp_group

    group = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
    try:
        total = group.all_reduce(torch.tensor([1.5, -2.0]) * (rank + 1))
        low = group.all_reduce(torch.tensor([10 + rank]), op="min")
        high = group.all_reduce(torch.tensor([10 + rank]), op="max")
        ids = group.broadcast(torch.tensor([7, 8, 9]) if rank == 0 else torch.zeros(3, dtype=torch.int64))
        payload = group.broadcast_bytes("ünïcode 🚀 step".encode() if rank == 0 else None)
        empty = group.broadcast_bytes(b"" if rank == 0 else None)
        group.barrier()
        out.put((rank, total.tolist(), int(low), int(high), ids.tolist(), payload, empty))
    finally:
        group.close()
        group.close()  # idempotent


def test_collectives_over_two_ranks() -> None:
    got, exitcodes = run_ranks(_rank)
    assert len(got) == 2, "a rank did not report within the time limit"
    for rank, total, low, high, ids, payload, empty in got:
        assert total == [1.5 + 3.0, -2.0 - 4.0]
        assert (low, high) == (10, 11)
        assert ids == [7, 8, 9]
        assert payload == "ünïcode 🚀 step".encode() and empty == b""
    assert exitcodes == [0, 0]
