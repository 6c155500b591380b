"""The torch backend's decode mirror (common/attention/decode_mirror.py) over many steps: every
step's output must equal the gather path's on the same pool, and a per-request float64
reference, while requests join, leave, come back in another order, reuse a row for a new
request, skip a step, outgrow the lanes' capacity, and exceed the memory budget."""
from __future__ import annotations

import random

import pytest
import torch

from common import kernels
from common.attention.base import AttentionLayerSpec
from common.attention.decode_mirror import KEY_BLOCK, MirrorPlan
from common.attention.torch_backend import TorchAttentionBackend
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.kvcache.pool import KVLayout, KVPool
from common.kvcache.req_to_token import ReqToTokenPool

PAGE = 4
HEADS, KV_HEADS, D = 4, 2, 8  # head_dim 8: the torch-op path (the native kernel takes multiples of 16)
# Dimensions for the tests that run both decode paths: the torch ops, and the native kernel (a
# GQA group of 3 as SmolLM2's, head_dim 16).
PATHS = pytest.mark.parametrize("dims", [(HEADS, KV_HEADS, D), (6, 2, 16)], ids=["torch-ops", "native"])
LAYERS = 2


class Sim:
    """Requests on a paged pool with scattered pages; one DECODE batch per ``step``."""

    def __init__(self, seed: int = 0, dims: tuple[int, int, int] = (HEADS, KV_HEADS, D)) -> None:
        self.heads, self.kv_heads, self.d = dims
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        layout = KVLayout(num_layers=LAYERS, num_kv_heads=self.kv_heads, head_dim=self.d, page_size=PAGE, dtype="float32")
        self.pool = KVPool(layout, 2000, "cpu")
        for buf in self.pool.buffers():
            buf.copy_(torch.randn(buf.shape, generator=self.gen))
        self.rows = ReqToTokenPool(40, 512, "cpu")
        self.free_pages = list(range(1, 2000))
        self.rng.shuffle(self.free_pages)
        self.lens: dict[int, int] = {}  # row -> tokens in the KV
        self.pages: dict[int, list[int]] = {}

    def admit(self, prompt_len: int) -> int:
        """A request whose prompt K/V (random, already in its pages) arrived: its row."""
        row = self.rows.alloc()
        assert row is not None
        self.lens[row], self.pages[row] = 0, []
        self._grow(row, prompt_len)
        self.lens[row] = prompt_len
        return row

    def finish(self, row: int) -> None:
        self.free_pages.extend(self.pages.pop(row))
        del self.lens[row]
        self.rows.free(row)

    def _grow(self, row: int, length: int) -> None:
        while len(self.pages[row]) * PAGE < length:
            page = self.free_pages.pop()
            self.rows.table[row, len(self.pages[row]) * PAGE:(len(self.pages[row]) + 1) * PAGE] = torch.arange(
                page * PAGE, (page + 1) * PAGE, dtype=torch.int32)
            self.pages[row].append(page)

    def step(self, order: list[int], backends: list[TorchAttentionBackend]) -> list[torch.Tensor]:
        """One decode step of the rows in ``order`` through each backend (same q/k/v); each row
        gains a token. Returns per backend per layer outputs, then the reference last."""
        for row in order:
            self._grow(row, self.lens[row] + 1)
        prefix = [self.lens[r] for r in order]
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        table = self.rows.table
        out_loc = table[t(order), t(prefix)].long()
        seq = [p + 1 for p in prefix]
        hq, hk, d = self.heads, self.kv_heads, self.d
        qs = [torch.randn(len(order), hq * d, generator=self.gen) for _ in range(LAYERS)]
        ks = [torch.randn(len(order), hk * d, generator=self.gen) for _ in range(LAYERS)]
        vs = [torch.randn(len(order), hk * d, generator=self.gen) for _ in range(LAYERS)]
        outs = []
        for backend in backends:
            batch = ForwardBatch(ForwardMode.DECODE, t([0] * len(order)), t(prefix), out_loc, t(order), t(seq), t(prefix),
                                 t([1] * len(order)), table, self.pool, seq, prefix, [1] * len(order),
                                 rows_cpu=list(order), row_epochs=[self.rows.epoch[r] for r in order])
            backend.init_forward_metadata(batch)
            outs.append(torch.stack([backend.forward(qs[i], ks[i], vs[i], AttentionLayerSpec(i, hq, hk, d, d**-0.5), batch)
                                     for i in range(LAYERS)]))
        outs.append(torch.stack([self._reference(order, seq, qs[i], i) for i in range(LAYERS)]))
        for row in order:
            self.lens[row] += 1
        return outs

    def _reference(self, order: list[int], seq: list[int], q: torch.Tensor, layer: int) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer].double(), self.pool.v_buffers[layer].double()
        rows = []
        for i, (row, n) in enumerate(zip(order, seq)):
            slots = self.rows.table[row, :n].long()
            qi = q[i].double().view(self.heads, self.d)
            heads = []
            for h in range(self.heads):
                kh = h // (self.heads // self.kv_heads)
                w = torch.softmax(k_buf[slots, kh] @ qi[h] * self.d**-0.5, dim=0)
                heads.append(w @ v_buf[slots, kh])
            rows.append(torch.cat(heads))
        return torch.stack(rows).float()


def native_calls(backend: TorchAttentionBackend, dims: tuple[int, int, int]) -> list[int]:
    """Count the backend's calls of the native kernel; with the "native" dims the kernel must be
    there (a machine without a C++ compiler skips: the torch-op case covers it)."""
    calls = [0]
    if dims[2] % 16:
        backend.native_decode = None
        return calls
    if backend.native_decode is None:
        if kernels._compiler() is None:
            pytest.skip("no C++ compiler: the native kernel cannot be built here")
        raise AssertionError("a C++ compiler is here but the native decode kernel did not load")
    kernel = backend.native_decode

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return kernel(*args, **kw)

    counted.supports = kernel.supports  # type: ignore[attr-defined]
    backend.native_decode = counted  # type: ignore[assignment]
    return calls


def check(outs: list[torch.Tensor]) -> None:
    mirrored, gathered, ref = outs
    torch.testing.assert_close(mirrored, gathered, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mirrored, ref, rtol=1e-4, atol=1e-5)


@PATHS
def test_mirror_equals_the_gather_path_through_joins_leaves_reuse_and_growth(dims: tuple[int, int, int]) -> None:
    sim = Sim(seed=1, dims=dims)
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=64 << 20), TorchAttentionBackend()
    calls = native_calls(mirror, dims)
    live = [sim.admit(n) for n in (3, 17, 60, 1, 9)]
    planned = 0
    for step in range(90):
        if step % 7 == 3:  # a request finishes; its row goes back and a new request may take it
            sim.finish(live.pop(sim.rng.randrange(len(live))))
        if step % 5 == 0 and len(live) < 30:  # a new arrival; prompt lengths cross S_cap steps (64, 128)
            live.append(sim.admit(sim.rng.choice([1, 5, 40, 63, 64, 65, 120])))
        order = live[:]
        if step % 3 == 0:
            sim.rng.shuffle(order)  # the batch's order is not the lanes' order
        outs = sim.step(order, [mirror, gather])
        check(outs)
        planned += mirror.mirror is not None and mirror.mirror.lanes_in_use == len(order)
    assert planned == 90  # every step ran on the mirror, none fell back
    assert calls[0] == (90 * LAYERS if dims[2] % 16 == 0 else 0)
    assert mirror.mirror is not None and mirror.mirror.nbytes() > 0
    # Keys in blocks of 16 positions exactly where the kernel reads them.
    assert mirror.mirror.blocked == (dims[2] % 16 == 0)
    assert mirror.mirror.whole(0)[0].dim() == (5 if dims[2] % 16 == 0 else 4)


def test_blocked_keys_without_the_kernel_fill_move_append_and_copy_out_exactly() -> None:
    """A blocked mirror read by the torch ops (``plain_keys``): the blocked fills (whole blocks
    and a part), moves of whole blocks, appends into a block's column and growth of S_cap all land
    where a plain mirror has them, on any machine (no kernel involved). Lengths around a block (64)
    and its multiples."""
    dims = (6, 2, 16)
    sim = Sim(seed=6, dims=dims)
    blocked, plain, gather = (TorchAttentionBackend(decode_mirror_bytes=64 << 20),
                              TorchAttentionBackend(decode_mirror_bytes=64 << 20), TorchAttentionBackend())
    for backend, wants in ((blocked, True), (plain, False)):
        backend.native_decode = None
        assert backend.mirror is not None
        backend.mirror.blocked_keys = wants
    live = [sim.admit(n) for n in (63, 64, 65, 33, 1)]
    for step in range(80):
        if step % 6 == 2:  # the last lane moves into the hole
            sim.finish(live.pop(sim.rng.randrange(len(live) - 1)))
        if step % 4 == 0 and len(live) < 12:  # lengths around a block, crossing S_cap (64, 128)
            live.append(sim.admit(sim.rng.choice([1, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129])))
        order = live[:]
        if step % 3 == 0:
            sim.rng.shuffle(order)
        mirrored, plain_out, gathered, ref = sim.step(order, [blocked, plain, gather])
        check([mirrored, gathered, ref])
        assert torch.equal(mirrored, plain_out)  # the same keys, so the same float ops
    assert blocked.mirror.blocked and not plain.mirror.blocked
    b_k, p_k = blocked.mirror.whole(1)[0], plain.mirror.whole(1)[0]
    assert b_k.dim() == 5 and b_k.shape[4] == KEY_BLOCK and b_k.shape[2] * KEY_BLOCK == p_k.shape[3]
    n, s = blocked.mirror.lanes_in_use, max(sim.lens[r] for r in live)
    b_plain, p_plain = blocked.mirror.plain_keys(1, n, s), plain.mirror.plain_keys(1, n, s)
    for lane, length in enumerate(blocked.mirror._len):  # past a lane's length the two may differ
        assert torch.equal(b_plain[lane, :, :, :length], p_plain[lane, :, :, :length])


@PATHS
def test_growth_in_the_step_a_lane_moves_keeps_every_lane(dims: tuple[int, int, int]) -> None:
    """Growing copies only the filled positions of each lane, and of the lanes this step's moves
    read (the last lane, moving into a finished request's hole, is no longer in use when the new
    buffers are made): a finish, a move and an S_cap growth in one step, then more steps."""
    sim = Sim(seed=7, dims=dims)
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=64 << 20), TorchAttentionBackend()
    native_calls(mirror, dims)
    a, b, c = sim.admit(10), sim.admit(20), sim.admit(62)
    for _ in range(2):  # c attends 63, then 64 keys: S_cap 64
        check(sim.step([a, b, c], [mirror, gather]))
    assert mirror.mirror is not None and mirror.mirror.whole(0)[1].shape[2] == 64
    sim.finish(a)  # c's lane (the last) moves into a's, and c's 65 keys grow S_cap to 128
    for _ in range(3):
        check(sim.step([b, c], [mirror, gather]))
    assert mirror.mirror.whole(0)[1].shape[2] == 128 and mirror.mirror.lanes_in_use == 2


@PATHS
def test_a_reused_row_or_a_skipped_step_refills_the_lane(dims: tuple[int, int, int]) -> None:
    sim = Sim(seed=2, dims=dims)
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=64 << 20), TorchAttentionBackend()
    native_calls(mirror, dims)
    a, b = sim.admit(10), sim.admit(20)
    check(sim.step([a, b], [mirror, gather]))
    # b finishes and a new request gets the same row with as many tokens as b's lane: only the epoch
    # tells them apart (the pool holds different K/V for it).
    length = sim.lens[b]
    sim.finish(b)
    c = sim.admit(length)
    assert c == b
    check(sim.step([a, c], [mirror, gather]))
    # a skips one step on the mirror's side (the gather backend ran it): its lane is one short.
    check(sim.step([a], [gather, TorchAttentionBackend()]))
    check(sim.step([a, c], [mirror, gather]))


def test_over_budget_falls_back_to_the_gather_path_and_frees_the_mirror() -> None:
    """A request no lane budget holds attends from the pages; alone, the mirror frees itself."""
    sim = Sim(seed=3)
    per_token = LAYERS * 2 * KV_HEADS * D * 4
    budget = 4 * 64 * per_token  # 256 positions resident, capacities up to 8x that
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=budget), TorchAttentionBackend()
    rows = [sim.admit(30) for _ in range(4)]  # 4 x 64 resident: the budget
    check(sim.step(rows, [mirror, gather]))
    assert mirror.mirror is not None and mirror.mirror.nbytes() > 0
    long_row = sim.admit(300)  # 320 resident: over the budget alone
    check(sim.step([long_row], [mirror, gather]))  # not even one lane of it fits: all from the pages
    assert mirror.mirror.nbytes() == 0 and mirror.mirror.lanes_in_use == 0
    check(sim.step(rows + [long_row], [mirror, gather]))  # the short ones fit without it
    assert mirror.mirror.lanes_in_use == len(rows) and mirror.mirror.resident_bytes() <= budget
    sim.finish(long_row)  # back under budget: every request is mirrored again
    check(sim.step(rows, [mirror, gather]))
    assert mirror.mirror.lanes_in_use == len(rows)


@PATHS
def test_a_long_request_keeps_its_lane_while_what_is_resident_fits(dims: tuple[int, int, int]) -> None:
    """Lanes share one capacity, the longest request's, but on the CPU only written positions are
    resident: a long request among short ones keeps its lane while their keys fit the budget,
    though the capacities are past it, so the step stays whole (the native kernel's). A request
    whose keys would pass the budget is left out (the pages serve it) while the rest keep their
    lanes; once it leaves, the whole batch is mirrored again. Every step equals the gather path
    and the reference."""
    from common.attention.torch_backend import _PartlyMirrored

    sim = Sim(seed=7, dims=dims)
    heads, kv_heads, d = dims
    per_token = LAYERS * 2 * kv_heads * d * 4
    budget = 16 * 64 * per_token  # 1024 positions resident
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=budget), TorchAttentionBackend()
    calls = native_calls(mirror, dims)
    live = [sim.admit(n) for n in (5, 20, 33, 40, 9, 12, 30, 3, 17)]  # 9 x 64 resident
    check(sim.step(live, [mirror, gather]))
    assert isinstance(mirror_plan(sim, mirror, live), MirrorPlan)
    long_row = sim.admit(130)  # + 192 resident; capacities 16 lanes x 192 positions, 3x the budget
    live.insert(4, long_row)
    for step in range(3):
        order = live[:]
        if step % 2:
            sim.rng.shuffle(order)
        assert isinstance(mirror_plan(sim, mirror, order), MirrorPlan)
        check(sim.step(order, [mirror, gather]))
    assert mirror.mirror is not None and mirror.mirror.nbytes() > budget >= mirror.mirror.resident_bytes()
    longer = sim.admit(400)  # + 448 resident: past the budget with the others
    live.insert(2, longer)
    for step in range(4):
        order = live[:]
        if step % 2:
            sim.rng.shuffle(order)
        meta = mirror_plan(sim, mirror, order)
        check(sim.step(order, [mirror, gather]))
        assert isinstance(meta, _PartlyMirrored)
        assert order.index(longer) not in meta.mirrored.tolist() and len(meta.mirrored) == len(order) - 1
        assert mirror.mirror.resident_bytes() <= budget
    live.remove(longer)
    sim.finish(longer)
    check(sim.step(live, [mirror, gather]))
    assert isinstance(mirror_plan(sim, mirror, live), MirrorPlan)
    assert calls[0] == (9 * LAYERS if dims[2] % 16 == 0 else 0)


def mirror_plan(sim: Sim, backend: TorchAttentionBackend, order: list[int]) -> object:
    """What the backend would plan for this batch now (a dry run on a throwaway copy of the
    mirror's state would change it, so plan on the real one: the next step plans the same)."""
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    prefix = [sim.lens[r] for r in order]
    table = sim.rows.table
    batch = ForwardBatch(ForwardMode.DECODE, t([0] * len(order)), t(prefix), table[t(order), t(prefix)].long(), t(order),
                         t([p + 1 for p in prefix]), t(prefix), t([1] * len(order)), table, sim.pool,
                         [p + 1 for p in prefix], prefix, [1] * len(order), rows_cpu=list(order),
                         row_epochs=[sim.rows.epoch[r] for r in order])
    backend.init_forward_metadata(batch)
    return batch.attn_metadata


def test_reset_after_a_failed_forward_refills_every_lane() -> None:
    sim = Sim(seed=4)
    mirror, gather = TorchAttentionBackend(decode_mirror_bytes=64 << 20), TorchAttentionBackend()
    rows = [sim.admit(n) for n in (5, 6, 7)]
    check(sim.step(rows, [mirror, gather]))
    mirror.reset()
    assert mirror.mirror is not None and mirror.mirror.lanes_in_use == 0
    check(sim.step(rows, [mirror, gather]))


def test_extend_batches_and_tables_without_rows_use_the_gather_path() -> None:
    sim = Sim(seed=5)
    backend = TorchAttentionBackend(decode_mirror_bytes=64 << 20)
    row = sim.admit(8)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(ForwardMode.DECODE, t([0]), t([8]), sim.rows.table[row, 8:9].long(), t([row]), t([9]), t([8]),
                         t([1]), sim.rows.table, sim.pool, [9], [8], [1])  # no rows_cpu: built by hand
    backend.init_forward_metadata(batch)
    assert not isinstance(batch.attn_metadata, MirrorPlan)
