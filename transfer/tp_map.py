"""Which prefill rank sends which KV heads to which decode rank, for unequal TP sizes.

A pure module: no I/O, no tensors. With TP size ``t`` and ``H`` KV heads, rank ``r`` holds heads
``r*H//t .. (r+1)*H//t`` when ``t <= H`` (needs ``H % t == 0``), and when ``t > H`` one head, a
replicated copy of head ``r // (t // H)`` (needs ``t % H == 0``). Local head offsets count from
the rank's first head. A decode rank receives each of its heads exactly once; when prefill holds a
head on several ranks, the replica ``decode_rank % replicas`` sends it, so consecutive decode ranks
draw on different prefill ranks. Anything that cannot be served raises ``LayoutMismatch`` naming the
field, before any transfer starts.
"""
from __future__ import annotations

from dataclasses import dataclass

from bootstrap_server.errors import LayoutMismatch


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """``num_heads`` heads copied from ``src_rank``'s local offset to the decode rank's local offset."""

    src_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int


@dataclass(frozen=True, slots=True)
class RankHeads:
    """The global heads one rank holds: ``first .. first + count``."""

    first: int
    count: int


def rank_heads(tp_size: int, num_kv_heads: int, rank: int, *, side: str = "") -> RankHeads:
    """Rank ``rank``'s heads under the pool contract; ``side`` prefixes the field in errors."""
    field = f"{side}tp_size" if side else "tp_size"
    if tp_size < 1 or num_kv_heads < 1:
        raise LayoutMismatch(f"{field} {tp_size} and num_kv_heads {num_kv_heads} must be >= 1")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp_size {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutMismatch(f"num_kv_heads {num_kv_heads} is not divisible by {field} {tp_size}")
        per_rank = num_kv_heads // tp_size
        return RankHeads(rank * per_rank, per_rank)
    if tp_size % num_kv_heads:
        raise LayoutMismatch(f"{field} {tp_size} is not a multiple of num_kv_heads {num_kv_heads}")
    return RankHeads(rank // (tp_size // num_kv_heads), 1)


def _source_of(head: int, prefill_tp: int, num_kv_heads: int, decode_rank: int) -> tuple[int, int]:
    """(prefill rank, local offset) that sends global ``head`` to ``decode_rank``."""
    if prefill_tp <= num_kv_heads:
        per_rank = num_kv_heads // prefill_tp
        return head // per_rank, head % per_rank
    replicas = prefill_tp // num_kv_heads
    return head * replicas + decode_rank % replicas, 0


@dataclass(frozen=True, slots=True)
class TPMap:
    """The whole plan for one (prefill TP, decode TP, KV heads) pair."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    # per decode rank, the slices it receives, ordered by destination offset
    recv: tuple[tuple[HeadSlice, ...], ...]

    def sources(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks ``decode_rank`` must hear Success from, ascending."""
        return tuple(sorted({s.src_rank for s in self.recv[decode_rank]}))

    def destinations(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks ``prefill_rank`` sends to, ascending; may be empty (an unused replica)."""
        return tuple(d for d in range(self.decode_tp) if prefill_rank in self.sources(d))

    def required_dst_info_num(self, prefill_rank: int) -> int:
        """How many decode ranks' ``TransferInfo`` ``prefill_rank`` waits for before it sends."""
        return len(self.destinations(prefill_rank))

    def slices_to(self, prefill_rank: int, decode_rank: int) -> tuple[HeadSlice, ...]:
        """What ``prefill_rank`` writes into ``decode_rank``'s pool."""
        return tuple(s for s in self.recv[decode_rank] if s.src_rank == prefill_rank)

    def aux_rank(self, decode_rank: int) -> int:
        """The one prefill rank that writes ``decode_rank``'s aux row and state: its lowest source."""
        return self.sources(decode_rank)[0]


def plan(
    prefill_tp: int,
    decode_tp: int,
    num_kv_heads: int,
    *,
    prefill_page_size: int | None = None,
    decode_page_size: int | None = None,
    has_sharded_state: bool = False,
) -> TPMap:
    """Map every decode rank's heads to prefill sources, or raise ``LayoutMismatch`` naming the field.

    ``has_sharded_state``: the model carries per-rank recurrent state split by TP rank; it is sent
    whole by one rank, so it cannot be resharded between unequal TP sizes.
    """
    if prefill_page_size is not None and decode_page_size is not None and prefill_page_size != decode_page_size:
        raise LayoutMismatch(f"page_size differs: prefill {prefill_page_size}, decode {decode_page_size}")
    if has_sharded_state and prefill_tp != decode_tp:
        raise LayoutMismatch(
            f"state_layout: per-rank recurrent state cannot be resharded from tp_size {prefill_tp} to {decode_tp}"
        )
    rank_heads(prefill_tp, num_kv_heads, 0, side="prefill ")  # validates divisibility
    recv: list[tuple[HeadSlice, ...]] = []
    for d in range(decode_tp):
        mine = rank_heads(decode_tp, num_kv_heads, d, side="decode ")
        slices: list[HeadSlice] = []
        for dst_offset in range(mine.count):
            src_rank, src_offset = _source_of(mine.first + dst_offset, prefill_tp, num_kv_heads, d)
            last = slices[-1] if slices else None
            if (
                last is not None
                and last.src_rank == src_rank
                and last.src_head_offset + last.num_heads == src_offset
                and last.dst_head_offset + last.num_heads == dst_offset
            ):
                # adjacent heads from the same rank merge, so equal TP is one slice per rank
                slices[-1] = HeadSlice(src_rank, last.src_head_offset, last.dst_head_offset, last.num_heads + 1)
            else:
                slices.append(HeadSlice(src_rank, src_offset, dst_offset, 1))
        recv.append(tuple(slices))
    return TPMap(prefill_tp, decode_tp, num_kv_heads, tuple(recv))
