"""Which prefill rank sends which KV heads to which decode rank, for unequal TP sizes.

A pure module: no I/O, no tensors. With TP size ``t`` and ``H`` KV heads, rank ``r`` holds heads
``r*H//t .. (r+1)*H//t`` when ``t <= H`` (needs ``H % t == 0``), and when ``t > H`` one head, a
replicated copy of head ``r // (t // H)`` (needs ``t % H == 0``). Local head offsets count from
the rank's first head. A decode rank receives each of its heads exactly once; when prefill holds a
head on several ranks, the replica ``decode_rank % replicas`` sends it, so consecutive decode ranks
draw on different prefill ranks. Anything that cannot be served raises ``LayoutMismatch`` naming the
field, before any transfer starts.

A prefill rank that no decode rank draws from (an unused replica) still has the room: one decode
rank, ``prefill_rank % decode_tp``, tells it so with a TransferInfo for which it has nothing to
write (``informants``), so its room reaches a terminal state with the others'.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bootstrap_server.errors import LayoutMismatch
from bootstrap_server.heads import RankHeads, check_tp_pair, rank_heads

__all__ = ["HeadSlice", "RankHeads", "TPMap", "equal_plan", "plan", "rank_heads"]


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """``num_heads`` heads copied from ``src_rank``'s local offset to the decode rank's local offset."""

    src_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int


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

    def informants(self, prefill_rank: int) -> tuple[int, ...]:
        """The decode ranks whose TransferInfo ``prefill_rank`` waits for: its destinations, or
        for an unused replica the one decode rank that tells it it has nothing to send."""
        return self.destinations(prefill_rank) or (prefill_rank % self.decode_tp,)

    def contacts(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks ``decode_rank`` sends a TransferInfo to: its sources and the unused
        replicas it informs, ascending."""
        return tuple(p for p in range(self.prefill_tp) if decode_rank in self.informants(p))

    def required_dst_info_num(self, prefill_rank: int) -> int:
        """How many decode ranks' ``TransferInfo`` ``prefill_rank`` waits for before it sends."""
        return len(self.informants(prefill_rank))

    def slices_to(self, prefill_rank: int, decode_rank: int) -> tuple[HeadSlice, ...]:
        """What ``prefill_rank`` writes into ``decode_rank``'s pool (empty: nothing)."""
        return tuple(s for s in self.recv[decode_rank] if s.src_rank == prefill_rank)

    def aux_rank(self, decode_rank: int) -> int:
        """The one prefill rank that writes ``decode_rank``'s aux row and state: its lowest source."""
        return self.sources(decode_rank)[0]


def equal_plan(tp_size: int, heads_per_rank: int) -> TPMap:
    """Equal TP sizes: rank r to rank r, all its heads. Needs no model head count (a rank that does
    not know it still pairs with its own TP size), and is what ``plan`` gives for any count."""
    recv = tuple((HeadSlice(r, 0, 0, heads_per_rank),) for r in range(tp_size))
    return TPMap(tp_size, tp_size, 0, recv)


@lru_cache(maxsize=64)
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

    Cached: both managers ask for the same few plans on every room.

    ``has_sharded_state``: the model carries per-rank recurrent state split by TP rank; it is sent
    whole by one rank, so it cannot be resharded between unequal TP sizes.
    """
    if prefill_page_size is not None and decode_page_size is not None and prefill_page_size != decode_page_size:
        raise LayoutMismatch(f"page_size differs: prefill {prefill_page_size}, decode {decode_page_size}")
    if has_sharded_state and prefill_tp != decode_tp:
        raise LayoutMismatch(
            f"state_layout: per-rank recurrent state cannot be resharded from tp_size {prefill_tp} to {decode_tp}"
        )
    check_tp_pair(prefill_tp, decode_tp)
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
