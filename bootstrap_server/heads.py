"""Which KV heads a tensor-parallel rank holds: the KV pool contract, as plain arithmetic.

With TP size ``t`` and ``H`` KV heads (the model's total, registered by every rank, never
back-computed from a rank's own count), rank ``r`` holds heads ``r*H/t .. (r+1)*H/t`` when
``t <= H`` (needs ``H % t == 0``), and when ``t > H`` one head, a replica of head ``r // (t/H)``
(needs ``t % H == 0``). ``common.models.sharding.attention_shard`` shards the model the same way;
this copy lives here because the registry checks registrations against it and must not import
torch. A pair of sides it cannot serve raises ``LayoutMismatch`` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from bootstrap_server.errors import LayoutMismatch


@dataclass(frozen=True, slots=True)
class RankHeads:
    """The global heads one rank holds: ``first .. first + count``."""

    first: int
    count: int


def rank_heads(tp_size: int, num_kv_heads: int, rank: int, *, side: str = "") -> RankHeads:
    """Rank ``rank``'s heads under the pool contract; ``side`` ("prefill "/"decode ") prefixes
    the field in errors."""
    field = f"{side}tp_size" if side else "tp_size"
    if tp_size < 1 or num_kv_heads < 1:
        raise LayoutMismatch(f"{field} {tp_size} and num_kv_heads {num_kv_heads} must be >= 1")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutMismatch(f"total_kv_heads {num_kv_heads} is not divisible by {field} {tp_size}")
        per_rank = num_kv_heads // tp_size
        return RankHeads(rank * per_rank, per_rank)
    if tp_size % num_kv_heads:
        raise LayoutMismatch(f"{field} {tp_size} is not a multiple of total_kv_heads {num_kv_heads}")
    return RankHeads(rank // (tp_size // num_kv_heads), 1)


def check_tp_pair(prefill_tp: int, decode_tp: int) -> None:
    """Unequal TP sizes are served only when one divides the other (2 -> 1, 1 -> 4, 4 -> 2, ...).

    Other pairs (2 -> 3 with 6 heads) could be mapped head by head, but a decode rank would then
    draw on sources with uneven shares; they are refused rather than served untested."""
    small, large = sorted((prefill_tp, decode_tp))
    if large % small:
        raise LayoutMismatch(f"tp_size: prefill {prefill_tp} and decode {decode_tp} do not divide each other")
