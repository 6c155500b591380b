"""Head-slice staging without managers: descriptors applied as plain memory copies land every
head of every page where the plan says, also when the decode's staging pages for a room are split
over several extents and the prefill's arena holds less than a chunk (the managers' tests cover
single extents; this covers the fragmented case)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from bootstrap_server.heads import rank_heads
from common.kvcache.pool import KVLayout, KVPool
from transfer import messages as m
from transfer import wire
from transfer.aux import AuxPool
from transfer.descriptors import Descriptors
from transfer.factory import node_kv_args
from transfer.staging import Arena, StagingArea, route, slice_descriptors

PAGES, PAGE, DIM, LAYERS = 12, 2, 3, 2


def args_of(tp: int, rank: int, total: int, staging: int):  # type: ignore[no-untyped-def]
    lay = KVLayout(num_layers=LAYERS, num_kv_heads=rank_heads(tp, total, rank).count, head_dim=DIM, page_size=PAGE,
                   dtype="float32")
    pool = KVPool(lay, PAGES, "cpu")
    return node_kv_args(pool, None, AuxPool(2), "127.0.0.1", tp_rank=rank, tp_size=tp, total_kv_heads=total,
                        staging_pages=staging), pool


@pytest.mark.parametrize("tp_p,tp_d,total", [(2, 1, 4), (4, 1, 4), (4, 1, 2), (1, 2, 4), (1, 4, 2)])
def test_slices_land_exactly_over_fragmented_extents_and_a_small_arena(tp_p: int, tp_d: int, total: int) -> None:
    src_pages, dst_pages = [1, 2, 3, 7, 8], [4, 9, 10, 11, 2]
    decode, dpool = args_of(tp_d, 0, total, staging=PAGES)
    area = StagingArea(PAGES, decode.page_unit_nbytes, torch.device("cpu"))
    extents = [(6, 2), (1, 1), (9, 2)]  # a room over three extents, out of order
    reg = wire.register_message(decode, "d", "i", "tcp://127.0.0.1:1", (area.buf.data_ptr(), area.buf.numel()))
    info = m.TransferInfo(room=1, session_id="d", instance_id="i", status_endpoint="tcp://127.0.0.1:1",
                          dst_pages=dst_pages, aux_slot=None, staging=extents)
    copies, slices = 0, []
    for p in range(tp_p):
        prefill, ppool = args_of(tp_p, p, total, staging=1)
        first = rank_heads(tp_p, total, p).first
        for b, t in enumerate(ppool.buffers()):  # value = (buffer, page, offset, global head, dim)
            v = t.view(PAGES, PAGE, -1, DIM)
            for h in range(v.shape[2]):
                v[:, :, h] = (torch.arange(PAGES)[:, None, None] * 100 + torch.arange(PAGE)[None, :, None] * 10
                              + torch.arange(DIM)[None, None, :]) + (b * 10 + first + h) * 10_000
        r = wire.peer_route(prefill, reg)  # what the prefill derives from the decode's registration
        assert r == route(tp_p, p, tp_d, 0, total) and (not r.direct or not r.slices)  # no slices: an unused replica
        slices.extend(r.slices)
        arena = Arena(prefill.staging_pages * prefill.page_unit_nbytes, torch.device("cpu"))
        pending: list[Descriptors] = []

        def flush() -> None:
            nonlocal copies
            for desc in pending:
                for s, dst, n in zip(desc.src, desc.dst, desc.lens):
                    ctypes.memmove(dst, s, n)
                    copies += 1
            pending.clear()
            arena.reset()

        def reserve(nbytes: int) -> int:
            if not arena.fits(nbytes):
                flush()
            return arena.take(nbytes)

        for at, n in ((0, 2), (2, 3)):  # two chunks
            slice_descriptors(prefill, r, src_pages[at:at + n], at, info, reg, arena, reserve, pending.append)
        flush()
    area.scatter(decode, slices, dst_pages, extents)  # copies only the slices that went through staging
    dfirst = rank_heads(tp_d, total, 0).first
    for b, t in enumerate(dpool.buffers()):
        v = t.view(PAGES, PAGE, -1, DIM)
        for i in range(PAGES):
            if i not in dst_pages:
                assert not v[i].any(), f"buffer {b}: page {i} was written"
        for sp, dp in zip(src_pages, dst_pages):
            for h in range(v.shape[2]):
                want = (sp * 100 + torch.arange(PAGE)[:, None] * 10 + torch.arange(DIM)[None, :]) + (b * 10 + dfirst + h) * 10_000
                assert torch.equal(v[dp, :, h], want.float()), f"buffer {b} page {dp} head {h}"
    assert copies > 0
