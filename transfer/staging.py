"""Head slices between unequal TP sizes: what one prefill rank writes into one decode rank, and
the staging that keeps that to a few descriptors per room.

A page is token-major (``[page_size, heads, head_dim]`` per buffer), so a head slice of a page is
``page_size`` separate byte ranges: sent as it lies it would cost one descriptor per token and
buffer (the ~30,000 ops per request of sglang PR 19890). A route is therefore one of::

    direct    the slice is every head of both ranks (equal TP): pages -> pages, zero-copy,
              one descriptor per page run and buffer, as without TP
    gather    the prefill holds more heads than it sends (Tp < Td): its worker copies the slice of
              a chunk's pages into its registered staging arena as ``[buffer][page][page_size, n,
              head_dim]``, whose rows are exactly the decode's rows: arena -> decode pages, one
              descriptor per destination page run and buffer (what equal TP costs)
    scatter   the decode holds more heads than one source sends (Tp > Td): the source gathers its
              slice page-major, ``[page][buffer][...]``, into its arena and writes it into the
              room's pages of the decode's staging area, laid out per extent and slice the same
              way: one descriptor per chunk and extent, all buffers at once (a source's buffers
              are separate tensors, so without the gather it would cost page runs x buffers,
              times Tp/Td sources per decode rank). The decode copies the slices into its pool
              pages when every source reported Success, before the room reports Success

``Route`` is computed from the plan (``transfer.tp_map``) on both sides alike. The decode's staging
area is a shadow of its pool in pages: a room takes as many staging pages as it has KV pages,
in extents (``StagingArea``), named in its TransferInfo, and gives them back when it is terminal
(or, fenced, when the fence lifts).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from transfer import descriptors as d
from transfer import messages as m
from transfer.args import KVArgs
from transfer.tp_map import HeadSlice, plan, rank_heads


@dataclass(frozen=True)
class Route:
    """What prefill rank p writes into decode rank d for every room (see the module docstring)."""

    slices: tuple[HeadSlice, ...]  # empty: nothing (an unused replica, told so by this decode rank)
    writes_aux: bool  # the aux row and state of d come from p
    gather: bool
    scatter: bool
    decode_heads: int  # KV heads of the decode rank's pool
    informs: bool  # d is one of the decode ranks p waits for (transfer.tp_map informants)
    required_infos: int  # how many decode ranks' TransferInfos p waits for, per room

    @property
    def direct(self) -> bool:
        return not (self.gather or self.scatter)


def route(prefill_tp: int, prefill_rank: int, decode_tp: int, decode_rank: int, total_kv_heads: int) -> Route:
    """The route between two ranks; raises ``LayoutMismatch`` for a pair that cannot be served."""
    tp = plan(prefill_tp, decode_tp, total_kv_heads)
    slices = tp.slices_to(prefill_rank, decode_rank)
    p_heads = rank_heads(prefill_tp, total_kv_heads, prefill_rank).count
    d_heads = rank_heads(decode_tp, total_kv_heads, decode_rank).count
    return Route(slices=slices, writes_aux=bool(slices) and tp.aux_rank(decode_rank) == prefill_rank,
                 gather=any(s.num_heads < p_heads for s in slices),
                 scatter=any(s.num_heads < d_heads for s in slices), decode_heads=d_heads,
                 informs=decode_rank in tp.informants(prefill_rank),
                 required_infos=tp.required_dst_info_num(prefill_rank))


def direct_route(rank: int, heads: int) -> Route:
    """Equal TP: rank r writes all its heads into rank r, as without TP."""
    return Route(slices=(HeadSlice(rank, 0, 0, heads),), writes_aux=True, gather=False, scatter=False,
                 decode_heads=heads, informs=True, required_infos=1)


class Arena:
    """A prefill worker's registered staging buffer, filled front to back and reset after the
    writes that read it returned (the worker's own bookkeeping: one thread)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
        self.ptr, self.nbytes = self.buf.data_ptr(), nbytes
        self.used = 0
        self.peak = 0  # most bytes held at once (observability and tests)

    def take(self, nbytes: int) -> int:
        """Offset of ``nbytes`` fresh bytes; the caller checked ``fits``."""
        off = self.used
        self.used += nbytes
        if self.used > self.nbytes:
            raise RuntimeError(f"staging arena overflow: {self.used} > {self.nbytes} bytes")
        self.peak = max(self.peak, self.used)
        return off

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.nbytes

    def reset(self) -> None:
        self.used = 0


def _page_view(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool buffer ``[slots, heads, head_dim]`` as ``[pages, page_size, heads, head_dim]``."""
    return t.view(t.shape[0] // page_size, page_size, *t.shape[1:])


def _pool_parts(s: HeadSlice, info: m.TransferInfo, peer: m.KVArgsRegister, first: int,
                count: int) -> Iterator[tuple[int, int, list[int], list[int]]]:
    """Room pages ``first .. first+count`` in the decode's pool: (offset, pages, pointer per
    buffer, destination pages)."""
    yield 0, count, list(peer.kv_ptrs), info.dst_pages[first:first + count]


def _staging_parts(r: Route, s: HeadSlice, info: m.TransferInfo, peer: m.KVArgsRegister, first: int, count: int,
                   unit: int, nbuf: int) -> Iterator[tuple[int, int, int]]:
    """Room pages ``first .. first+count`` of slice ``s`` in the decode's staging extents, in
    parts: (offset into those pages, pages, address of the first one). Within an extent of
    ``length`` pages the slice's block is ``[page][buffer][page_size, n, head_dim]``, so a run of
    room pages is one contiguous range for every buffer at once."""
    page_nbytes = sum(peer.kv_item_nbytes)  # one staging page: one decode page in every buffer
    sb = s.num_heads * unit
    pos = 0  # room page index where the current extent starts
    for start, length in info.staging:
        lo, hi = max(first, pos), min(first + count, pos + length)
        if lo < hi:
            block = peer.staging_ptr + start * page_nbytes + s.dst_head_offset * length * nbuf * unit
            yield lo - first, hi - lo, block + (lo - pos) * nbuf * sb
        pos += length


def slice_descriptors(args: KVArgs, r: Route, src_pages: Sequence[int], first: int, info: m.TransferInfo,
                      peer: m.KVArgsRegister, arena: Arena | None, reserve: Callable[[int], int],
                      emit: Callable[[d.Descriptors], None]) -> None:
    """The KV of one chunk (prefill pages ``src_pages``, room pages from ``first``) over a
    non-direct route, handed to ``emit`` piece by piece. ``reserve(nbytes)`` returns an arena
    offset, first writing out what was emitted so far if the arena is full: so a gathered piece
    is always emitted before its arena bytes can be reused."""
    assert arena is not None, "a staged route needs the staging arena (checked at registration)"
    lay = args.layout
    nbuf = len(args.kv)
    unit = args.kv.item_nbytes[0] // lay.num_kv_heads  # one head over one page
    for s in r.slices:
        sb = s.num_heads * unit  # one page of the slice, in one buffer
        per_piece = max(1, arena.nbytes // (nbuf * sb))
        for i in range(0, len(src_pages), per_piece):
            pages = list(src_pages[i:i + per_piece])
            n = len(pages)
            base = reserve(nbuf * n * sb)
            if r.scatter:  # [page][buffer]: a page run is one range for all buffers, on both sides
                _gather(args, pages, s, arena, base, page_major=True)
                for off, cnt, dst in _staging_parts(r, s, info, peer, first + i, n, unit, nbuf):
                    emit(d.Descriptors([arena.ptr + base + off * nbuf * sb], [dst], [cnt * nbuf * sb]))
            else:  # [buffer][page]: the decode's pool rows are the slice, one range per buffer and page run
                _gather(args, pages, s, arena, base, page_major=False)
                src_ptrs = [arena.ptr + base + b * n * sb for b in range(nbuf)]
                for off, cnt, dst_ptrs, dst_idx in _pool_parts(s, info, peer, first + i, n):
                    emit(d.build(list(range(off, off + cnt)), dst_idx, src_ptrs, dst_ptrs, [sb] * nbuf))


def _gather(args: KVArgs, pages: list[int], s: HeadSlice, arena: Arena, base: int, page_major: bool) -> None:
    """Copy heads ``s`` of ``pages`` of every buffer into the arena at ``base``, as
    ``[page][buffer][page_size, n, head_dim]`` (``page_major``) or ``[buffer][page][...]``."""
    lay = args.layout
    n, nbuf = len(pages), len(args.kv_tensors)
    idx = torch.as_tensor(pages, dtype=torch.long, device=args.kv_tensors[0].device)
    lo, hi = s.src_head_offset, s.src_head_offset + s.num_heads
    dtype = args.kv_tensors[0].dtype
    nbytes = n * nbuf * lay.page_size * s.num_heads * lay.head_dim * dtype.itemsize
    region = arena.buf[base:base + nbytes].view(dtype)
    shape = (n, nbuf) if page_major else (nbuf, n)
    out = region.view(*shape, lay.page_size, s.num_heads, lay.head_dim)
    for b, t in enumerate(args.kv_tensors):
        (out[:, b] if page_major else out[b]).copy_(_page_view(t, lay.page_size)[idx][:, :, lo:hi])
    if arena.buf.is_cuda:  # the engine reads the arena as soon as the write starts
        torch.cuda.current_stream(arena.buf.device).synchronize()


class StagingArea:
    """A decode rank's registered staging area: ``pages`` staging pages, each one KV page of the
    rank in every buffer, handed to rooms in extents (first fit; a room that finds no single
    extent large enough takes several). Used under the manager's lock."""

    def __init__(self, pages: int, page_nbytes: int, device: torch.device) -> None:
        self.pages, self.page_nbytes = pages, page_nbytes
        self.buf = torch.zeros(pages * page_nbytes, dtype=torch.uint8, device=device)  # [pages * page_nbytes]
        self._free: list[tuple[int, int]] = [(0, pages)]  # (start, count), sorted, never adjacent

    def alloc(self, count: int) -> list[tuple[int, int]] | None:
        """Extents covering ``count`` pages, or None (nothing taken) when fewer are free."""
        if count <= 0:
            return []
        if sum(c for _, c in self._free) < count:
            return None
        fit = next((i for i, (_, c) in enumerate(self._free) if c >= count), None)
        order = [fit] if fit is not None else list(range(len(self._free)))
        taken, need = [], count
        for i in order:
            start, c = self._free[i]
            take = min(c, need)
            taken.append((start, take))
            need -= take
            if need == 0:
                break
        for start, take in taken:
            i = next(j for j, (s0, _) in enumerate(self._free) if s0 == start)
            s0, c = self._free[i]
            if c == take:
                del self._free[i]
            else:
                self._free[i] = (s0 + take, c - take)
        return taken

    def free(self, extents: Sequence[tuple[int, int]]) -> None:
        merged = sorted([*self._free, *extents])
        out: list[tuple[int, int]] = []
        for start, c in merged:
            if out and out[-1][0] + out[-1][1] > start:
                raise ValueError(f"staging pages {start}..{start + c - 1} freed twice")
            if out and out[-1][0] + out[-1][1] == start:
                out[-1] = (out[-1][0], out[-1][1] + c)
            else:
                out.append((start, c))
        self._free = out

    def free_pages(self) -> int:
        return sum(c for _, c in self._free)

    def scatter(self, args: KVArgs, slices: Sequence[HeadSlice], dst_pages: Sequence[int],
                extents: Sequence[tuple[int, int]]) -> None:
        """Copy the room's staged head slices into its pool pages (every slice of this rank that
        does not cover all its heads; the others were written in place). Per extent of ``length``
        pages, slice ``s``'s block is ``[page][buffer][page_size, n, head_dim]``."""
        lay = args.layout
        heads, nbuf = lay.num_kv_heads, len(args.kv_tensors)
        unit = args.kv.item_nbytes[0] // heads
        dtype, device = args.kv_tensors[0].dtype, args.kv_tensors[0].device
        pos = 0
        for start, length in extents:
            idx = torch.as_tensor(list(dst_pages[pos:pos + length]), dtype=torch.long, device=device)
            for s in slices:
                if s.num_heads == heads:
                    continue
                off = start * self.page_nbytes + s.dst_head_offset * length * nbuf * unit
                block = self.buf[off:off + length * nbuf * s.num_heads * unit].view(dtype)
                block = block.view(length, nbuf, lay.page_size, s.num_heads, lay.head_dim)
                lo, hi = s.dst_head_offset, s.dst_head_offset + s.num_heads
                for b, t in enumerate(args.kv_tensors):
                    _page_view(t, lay.page_size)[idx, :, lo:hi] = block[:, b]
            pos += length
        if self.buf.is_cuda:  # the scheduler reads the pages as soon as the room reports Success
            torch.cuda.current_stream(self.buf.device).synchronize()
