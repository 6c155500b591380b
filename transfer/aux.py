"""Aux rows: the per-request metadata the prefill writes next to the KV (first token, logprobs).

One fixed-size row per aux slot, in one registered host tensor, so the prefill writes a request's
whole record with a single descriptor::

    rows: uint8 [num_slots, row_nbytes]      (CPU; registered with the data plane)
    row = | room i64 | token_id i64 | cached_tokens i64 | logprob f32 | num_top i32 |
          | kv_digest u8 [16] | top_ids i64 [K] | top_logprobs f32 [K] | padding to 8 bytes |

``room`` lets the decode check that the row it reads was written for its room, not left over
from the previous owner of the slot. ``kv_digest`` is the prefill's keyed digest of the prompt's
KV (common/kvcache/page_digest.py), which the decode checks the arrived pages against. K (``top_k``) is part of the layout both sides must agree on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import AUX_TOP_K  # the aux row's top-k, declared with the node's settings
from transfer.buffers import BufferSet


@dataclass(frozen=True)
class AuxRecord:
    room: int
    token_id: int  # first token sampled by the prefill
    cached_tokens: int  # prompt tokens the prefill found in its prefix cache
    logprob: float = 0.0  # logprob of token_id
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = field(default=())
    kv_digest: bytes = b""  # 16 bytes when the prefill digests its KV, else empty


KV_DIGEST_BYTES = 16  # common/kvcache/page_digest.py DIGEST_BYTES (transfer/ may not import common/kvcache)


def aux_row_dtype(top_k: int) -> np.dtype:
    fields = [
        ("room", "<i8"), ("token_id", "<i8"), ("cached_tokens", "<i8"),
        ("logprob", "<f4"), ("num_top", "<i4"), ("kv_digest", "u1", (KV_DIGEST_BYTES,)),
        ("top_ids", "<i8", (top_k,)), ("top_logprobs", "<f4", (top_k,)),
    ]
    dt = np.dtype(fields)
    pad = (-dt.itemsize) % 8
    return np.dtype({"names": dt.names, "formats": [dt.fields[n][0] for n in dt.names],
                     "offsets": [dt.fields[n][1] for n in dt.names], "itemsize": dt.itemsize + pad})


def _digest_or_empty(raw: bytes) -> bytes:
    return raw if any(raw) else b""  # all zeros: the prefill sent none (a real one is never zero)


class AuxPool:
    """Fixed-size aux rows plus a free list of slots (each slot released exactly once)."""

    def __init__(self, num_slots: int, top_k: int = 0) -> None:
        if num_slots < 1 or top_k < 0:
            raise ValueError(f"AuxPool needs num_slots >= 1 and top_k >= 0, got {num_slots}, {top_k}")
        self.top_k = top_k
        self.num_slots = num_slots
        self.dtype = aux_row_dtype(top_k)
        self.row_nbytes = self.dtype.itemsize
        self.rows = torch.zeros((num_slots, self.row_nbytes), dtype=torch.uint8)  # [slots, row_nbytes]
        self._view = self.rows.numpy().view(self.dtype).reshape(num_slots)  # shares memory with rows
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    # --- slots -------------------------------------------------------------------------------
    def alloc(self) -> int | None:
        """A free slot, or None when all are in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"aux slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._view[slot] = np.zeros((), dtype=self.dtype)
        self._free.append(slot)

    def num_free(self) -> int:
        return len(self._free)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_slots, "aux slots lost"
        assert not self._used.intersection(self._free), "aux slot both free and used"

    # --- rows --------------------------------------------------------------------------------
    def write(self, slot: int, rec: AuxRecord) -> None:
        n = len(rec.top_ids)
        if n > self.top_k or len(rec.top_logprobs) != n:
            raise ValueError(f"aux record has {n} top logprobs, the pool holds at most {self.top_k}")
        row = self._view[slot]
        row["room"], row["token_id"], row["cached_tokens"] = rec.room, rec.token_id, rec.cached_tokens
        row["logprob"], row["num_top"] = rec.logprob, n
        if len(rec.kv_digest) not in (0, KV_DIGEST_BYTES):
            raise ValueError(f"aux record kv_digest has {len(rec.kv_digest)} bytes, expected {KV_DIGEST_BYTES} or 0")
        row["kv_digest"][:] = np.frombuffer(rec.kv_digest.ljust(KV_DIGEST_BYTES, b"\0"), dtype=np.uint8)
        row["top_ids"][:] = 0
        row["top_logprobs"][:] = 0
        row["top_ids"][:n] = rec.top_ids
        row["top_logprobs"][:n] = rec.top_logprobs

    def read(self, slot: int) -> AuxRecord:
        row = self._view[slot]
        n = int(row["num_top"])
        return AuxRecord(
            room=int(row["room"]), token_id=int(row["token_id"]), cached_tokens=int(row["cached_tokens"]),
            logprob=float(row["logprob"]), top_ids=tuple(int(x) for x in row["top_ids"][:n]),
            top_logprobs=tuple(float(x) for x in row["top_logprobs"][:n]),
            kv_digest=_digest_or_empty(row["kv_digest"].tobytes()),
        )

    def buffers(self) -> BufferSet:
        return BufferSet((self.rows.data_ptr(),), (self.rows.numel(),), (self.row_nbytes,))
