"""Contiguous copies of the decoding requests' K/V, so a torch decode step reads them in place.

The paged pool scatters a request's tokens over its pages, so the torch backend's general path
gathers every key and value of every request (``index_select``) on every layer of every step
before attention: the whole context is copied once per step only to be read once. On CPU that
copy was a third of a decode step. The mirror keeps one *lane* per decoding request::

    k[layer]: [lanes, kv_heads, head_dim, S_cap]      lane i, positions 0 .. len(i) - 1 filled
    v[layer]: [lanes, kv_heads, S_cap, head_dim]      (keys stored transposed: see below)
    decode step:  new token's K/V -> pool (the truth: transfer and prefix cache read it) and lane
                  attention over k[layer][:B, :, :, :S] and v[layer][:B, :, :S] (views, no copy)

Lanes live as long as their request keeps decoding:

- **fill**: a request seen for the first time (or whose lane is stale) copies its K/V from the
  pool once, on each layer's first call of that step;
- **append**: each step writes the new token at position ``len`` of the lane;
- **drop**: a request absent from a decode batch loses its lane; the last lane moves into the
  hole (one request's copy), so lanes ``0 .. B-1`` are always the batch, in their own order
  (queries are permuted into lane order and back, which costs ``B`` rows, not ``B x S``).

A lane is trusted only while its request row keeps the same *epoch* (bumped by every row
allocation, so a row reused by another request never inherits a lane) and its length is exactly
the step's prefix: anything else refills it. Memory is bounded by what is resident: on the CPU the
buffers are lazily zeroed mappings in small pages, so a lane holds memory for the positions
written into it, not for the capacity its lanes share (``plan_within_budget``); past the budget
the longest requests are left out (they attend from the pages), and when not even one fits the
mirror frees itself and the backend gathers as before.

Why keys are stored transposed: a decode step's scores are, per lane and KV head, a product of
the few query rows of that head (the GQA group) with S keys. MKL's batched product read keys
stored [S, head_dim] (the transposed operand) at ~10 GB/s, and [head_dim, S] (the plain one) at
~14 GB/s: SmolLM2-135M's shape, 32 lanes, 384 keys, one thread, AMD EPYC Zen 5
(docs/BENCHMARKS.md, "Fewer calls per layer, keys stored transposed, one write per batch").
Values stay [S, head_dim], their fast layout.

**Blocked keys** (``blocked_keys=True``, what the torch backend asks for when our C++ kernel reads
the mirror): the same transposed keys in blocks of 64 positions, each block's [head_dim, 64]
contiguous::

    k[layer]: [lanes, kv_heads, S_cap / 64, head_dim, 64]    position p: block p // 64, column p % 64

The kernel's score block then reads one whole block, and a head's keys front to back, instead of
head_dim short stretches S_cap apart (common/kernels/attention.h says why that matters). Only float32 with
head_dim a multiple of 16 is blocked (what the kernel takes); the torch ops read plain keys, so a
blocked mirror hands them a plain copy (``plain_keys``), which only a layer the kernel declined needs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import hugepages
from common.engine.forward_batch import ForwardBatch

_S_ALIGN = 64  # S_cap grows in steps of at least this (and doubles), so growth is rare
KEY_BLOCK = 64  # positions per key block of a blocked mirror (attention.h's KEY_BLOCK; S_cap is a multiple)
_VECTOR = 16  # floats per kernel vector: the kernel takes head_dim in whole vectors
# Address space the (lazily zeroed) buffers may map, as a multiple of the budget on what is
# resident: capacities are shared by every lane, so they run ahead of what lanes hold.
_ADDRESS_FACTOR = 8


@dataclass
class MirrorPlan:
    """One decode batch's view of the mirror (shared by every layer of the step)."""

    num_lanes: int  # B: lanes 0 .. B-1 are this batch's requests
    max_seq: int  # S: keys read per lane
    lanes: torch.Tensor  # [B] int64 lane of each batch row
    positions: torch.Tensor  # [B] int64 position of each row's new token
    to_lane: torch.Tensor | None  # [B] int64 batch row of each lane; None: lanes are in batch order
    from_lane: torch.Tensor | None  # [B] int64 lane of each batch row (to put outputs back); None: identity
    lane_lens: torch.Tensor  # [B] int32 keys of each lane (lane order, CPU): what the native kernel reads
    mask: torch.Tensor | None  # [B, 1, 1, S] bool in lane order; None: every lane has S keys
    bias: torch.Tensor | None  # the mask as float32 0 / -inf (built by the first layer that needs it)
    fills: list[tuple[int, torch.Tensor]]  # (lane, pool slots of positions 0 .. n-1) to copy in
    moves: list[tuple[int, int, int]]  # (from lane, to lane, length): compaction, before fills
    done_layers: set[int]


class DecodeMirror:
    def __init__(self, budget_bytes: int, blocked_keys: bool = False) -> None:
        """``blocked_keys``: lay float32 keys out in blocks (the module docstring) for the kernel."""
        self.budget_bytes = budget_bytes
        self.blocked_keys = blocked_keys
        self.blocked = False  # whether the buffers are blocked (decided with the first one)
        self._k: dict[int, torch.Tensor] = {}  # layer id -> [L_cap, kv_heads, head_dim, S_cap] (or blocked)
        self._v: dict[int, torch.Tensor] = {}  # layer id -> [L_cap, kv_heads, S_cap, head_dim]
        self._lanes_cap = 0
        self._s_cap = 0
        self._lane_of: dict[int, int] = {}  # request row -> lane
        self._row_of: list[int] = []  # lane -> request row (len = lanes in use)
        self._epoch: list[int] = []  # lane -> epoch of its row when filled
        self._len: list[int] = []  # lane -> positions filled
        # lane -> positions of its buffers ever written (a lane a shorter request took over keeps
        # the longer one's pages): what is resident of a lazily zeroed mirror
        self._touched: list[int] = []
        self._lazy = True  # buffers resident only where written (CPU); on a GPU they are whole
        self._token_bytes: dict[int, int] = {}  # layer id -> K+V bytes of one token (known once it ran)
        self.generation = 0  # bumped whenever a buffer is allocated or freed (pointers into them go stale)

    @property
    def lanes_in_use(self) -> int:
        return len(self._row_of)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def reset(self) -> None:
        """Forget every lane and free the buffers (after a failed forward, or over budget)."""
        self._k.clear()
        self._v.clear()
        self.generation += 1
        self._lanes_cap = self._s_cap = 0
        self._lane_of.clear()
        self._row_of, self._epoch, self._len, self._touched = [], [], [], []

    # -- planning (once per decode batch) -----------------------------------------------------

    def plan_within_budget(self, batch: ForwardBatch) -> tuple[MirrorPlan, list[int]] | None:
        """Lanes for as many of this batch's requests as the budget holds: the plan and the batch
        indices it covers (in the plan's row order), the longest requests left out first; None
        when not even one fits.

        The budget bounds what is resident. On the CPU the buffers are lazily zeroed mappings
        (``_zeros``), so a lane takes memory for the positions written into it, not for the
        shared capacity: one long request among many short ones sizes every lane's capacity to its
        length (16 lanes x 2176 keys of SmolLM2's shape: 1.6 GB of address space) but makes
        resident only its own keys and theirs. The capacities are bounded too, at
        ``_ADDRESS_FACTOR`` x the budget (1 x on a GPU, where buffers are whole). Requests left out
        attend from the pages (``TorchAttentionBackend``); a mirror whose resident pages (lanes that
        once held longer requests keep theirs) would pass the budget starts again from nothing
        when the batch alone fits."""
        seq = batch.seq_lens_cpu
        n = len(seq)
        if self._fits(batch, range(n), fresh=False):  # the common case needs no sorting
            keep = list(range(n))
            return self._plan_rows(batch, keep), keep
        longest_first = sorted(range(n), key=lambda i: -seq[i])
        for k in range(n):  # leave out the k longest
            if k > 0 and self._fits(batch, longest_first[k:], fresh=False):
                break
            if self._fits(batch, longest_first[k:], fresh=True):
                self.reset()  # fresh buffers: only what this batch holds becomes resident
                break
        else:
            self.reset()
            return None
        keep = sorted(longest_first[k:])
        return self._plan_rows(batch, keep), keep

    def resident_bytes(self) -> int:
        """The mirror's memory in use: written positions (whole key blocks) on the CPU, the whole
        buffers on a GPU."""
        if not self._lazy:
            return self.nbytes()
        return self._resident_positions() * sum(self._token_bytes.values())

    def _resident_positions(self) -> int:
        return sum(_blocks(t) for t in self._touched)

    def _caps(self, lanes: int, s: int, fresh: bool) -> tuple[int, int]:
        """(lanes, S) capacities that hold lanes x s: the ones held, grown, or grown from nothing."""
        lanes_cap, s_cap = (0, 0) if fresh else (self._lanes_cap, self._s_cap)
        return max(lanes_cap, _grow(lanes_cap, lanes, 8)), max(s_cap, _grow(s_cap, s, _S_ALIGN))

    def _fits(self, batch: ForwardBatch, index: Sequence[int], fresh: bool) -> bool:
        """Whether lanes for the batch requests at ``index`` stay within the budget: their
        capacities within ``_ADDRESS_FACTOR`` x it, and (CPU) the positions resident after this
        step within it, an upper bound (a new request is counted whole, though it may take over a
        lane's written pages)."""
        per_token = sum(self._token_bytes.values())
        if not per_token or not index:
            return True
        seq = batch.seq_lens_cpu
        lanes_cap, s_cap = self._caps(len(index), max(seq[i] for i in index), fresh)
        if not self._lazy:
            return lanes_cap * s_cap * per_token <= self.budget_bytes
        if lanes_cap * s_cap * per_token > _ADDRESS_FACTOR * self.budget_bytes:
            return False
        if fresh:
            return sum(_blocks(seq[i]) for i in index) * per_token <= self.budget_bytes
        resident = self._resident_positions()
        for i in index:
            lane = self._lane_of.get(batch.rows_cpu[i])
            held = self._touched[lane] if lane is not None and lane < len(self._touched) else 0
            resident += _blocks(max(held, seq[i])) - _blocks(held)
        return resident * per_token <= self.budget_bytes

    def _plan_rows(self, batch: ForwardBatch, index: list[int]) -> MirrorPlan:
        """The plan for the batch requests at ``index`` (lanes in that order), which ``_fits``."""
        rows = [batch.rows_cpu[i] for i in index]
        epochs = [batch.row_epochs[i] for i in index]
        seq = [batch.seq_lens_cpu[i] for i in index]
        n, s = len(rows), max(seq)
        self._lanes_cap, self._s_cap = self._caps(n, s, fresh=False)
        moves = self._drop_absent(set(rows))
        for _, dst, length in moves:
            self._touch(dst, length)
        fills: list[tuple[int, torch.Tensor]] = []
        lanes: list[int] = []
        for row, epoch, length in zip(rows, epochs, seq):
            lane = self._lane_of.get(row)
            if lane is None:
                lane = len(self._row_of)
                self._lane_of[row] = lane
                self._row_of.append(row)
                self._epoch.append(-1)
                self._len.append(-1)
            if self._epoch[lane] != epoch or self._len[lane] != length - 1:
                self._epoch[lane] = epoch
                fills.append((lane, batch.req_to_token[row, : length - 1].long()))
            self._len[lane] = length  # the forward appends the new token
            self._touch(lane, length)
            lanes.append(lane)
        dev = batch.req_pool_indices.device
        lanes_t = torch.tensor(lanes, dtype=torch.int64)
        in_order = lanes == list(range(n))
        to_lane = None if in_order else torch.empty(n, dtype=torch.int64).index_copy_(0, lanes_t, torch.arange(n))
        seq_by_lane = [0] * n
        for lane, length in zip(lanes, seq):
            seq_by_lane[lane] = length
        mask = None
        if min(seq) != s:
            mask = (torch.arange(s)[None, :] < torch.tensor(seq_by_lane)[:, None])[:, None, None, :].to(dev)
        return MirrorPlan(
            num_lanes=n, max_seq=s, lanes=lanes_t.to(dev),
            positions=torch.tensor([length - 1 for length in seq], dtype=torch.int64, device=dev),
            to_lane=None if to_lane is None else to_lane.to(dev),
            from_lane=None if in_order else lanes_t.to(dev),
            lane_lens=torch.tensor(seq_by_lane, dtype=torch.int32), mask=mask, bias=None, fills=fills, moves=moves, done_layers=set())

    def _touch(self, lane: int, length: int) -> None:
        """This step writes positions 0 .. length - 1 of ``lane`` (at most)."""
        if lane >= len(self._touched):
            self._touched.extend([0] * (lane + 1 - len(self._touched)))
        self._touched[lane] = max(self._touched[lane], length)

    def _drop_absent(self, present: set[int]) -> list[tuple[int, int, int]]:
        """Free the lanes of rows not in this batch; the last lane fills each hole."""
        moves: list[tuple[int, int, int]] = []
        lane = 0
        while lane < len(self._row_of):
            if self._row_of[lane] in present:
                lane += 1
                continue
            del self._lane_of[self._row_of[lane]]
            last = len(self._row_of) - 1
            if lane != last:
                row = self._row_of[last]
                self._row_of[lane], self._epoch[lane], self._len[lane] = row, self._epoch[last], self._len[last]
                self._lane_of[row] = lane
                moves.append((last, lane, self._len[last]))
            self._row_of.pop()
            self._epoch.pop()
            self._len.pop()
        return moves

    # -- per layer ----------------------------------------------------------------------------

    def layer_kv(self, layer_id: int, plan: MirrorPlan, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bring this layer's lanes up to date and append the new token; returns the K and V
        views attention reads: K^T [B, kv_heads, head_dim, S] (None from a blocked mirror: the
        kernel reads ``whole``, anything else ``plain_keys``) and V [B, kv_heads, S, head_dim] (pool dtype)."""
        mk, mv = self._sync(layer_id, plan, k_buf, v_buf)
        if self.blocked:  # the index tensors' dimension goes first: [B, kv_heads, head_dim]
            mk[plan.lanes, :, plan.positions // KEY_BLOCK, :, plan.positions % KEY_BLOCK] = k_new.to(mk.dtype)
        else:
            mk[plan.lanes, :, :, plan.positions] = k_new.to(mk.dtype)  # [B, kv_heads, head_dim]
        mv[plan.lanes, :, plan.positions] = v_new.to(mv.dtype)
        b, s = plan.num_lanes, plan.max_seq
        return (None if self.blocked else mk[:b, :, :, :s]), mv[:b, :, :s]

    def plain_keys(self, layer_id: int, lanes: int, s: int) -> torch.Tensor:
        """K^T [lanes, kv_heads, head_dim, s] of lanes 0 .. lanes - 1: a view of a plain mirror, a
        copy out of a blocked one."""
        mk = self._k[layer_id]
        if not self.blocked:
            return mk[:lanes, :, :, :s]
        n, hk, nblk, d, w = mk.shape
        blocks = -(-s // w)
        return mk[:lanes, :, :blocks].permute(0, 1, 3, 2, 4).reshape(lanes, hk, d, blocks * w)[..., :s]

    def prepare(self, plan: MirrorPlan, k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor]) -> None:
        """Bring every layer's lanes up to date for this step without appending: the whole-step
        kernel (common/models/native_decode.py) appends the new tokens itself, then reads ``whole``."""
        for layer_id, (k_buf, v_buf) in enumerate(zip(k_bufs, v_bufs)):
            self._sync(layer_id, plan, k_buf, v_buf)

    def _sync(self, layer_id: int, plan: MirrorPlan, k_buf: torch.Tensor,
              v_buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's buffers, with the plan's moves and fills applied (once per step)."""
        mk, mv = self._buffers(layer_id, k_buf, plan.moves)
        if layer_id not in plan.done_layers:
            plan.done_layers.add(layer_id)
            for src, dst, length in plan.moves:
                if self.blocked:  # whole blocks: the columns past length are never read
                    blocks = -(-length // KEY_BLOCK)
                    mk[dst, :, :blocks] = mk[src, :, :blocks]
                else:
                    mk[dst, :, :, :length] = mk[src, :, :, :length]
                mv[dst, :, :length] = mv[src, :, :length]
            for lane, slots in plan.fills:
                keys = k_buf.index_select(0, slots)  # [n, kv_heads, head_dim]
                n = slots.shape[0]
                if self.blocked:
                    full, rest = divmod(n, KEY_BLOCK)
                    hk, d = keys.shape[1:]
                    if full:  # [full * KEY_BLOCK, hk, d] -> [hk, full, d, KEY_BLOCK]
                        mk[lane, :, :full] = keys[: full * KEY_BLOCK].view(full, KEY_BLOCK, hk, d).permute(2, 0, 3, 1)
                    if rest:
                        mk[lane, :, full, :, :rest] = keys[full * KEY_BLOCK:].permute(1, 2, 0)
                else:
                    mk[lane, :, :, :n] = keys.permute(1, 2, 0)
                mv[lane, :, :n] = v_buf.index_select(0, slots).transpose(0, 1)
        return mk, mv

    def whole(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's whole buffers, [L_cap, kv_heads, head_dim, S_cap] (blocked: [L_cap,
        kv_heads, S_cap / 64, head_dim, 64]) and [L_cap, kv_heads, S_cap, head_dim] (after
        ``layer_kv`` of this step): the native kernel takes them with the lanes' lengths instead of
        views."""
        return self._k[layer_id], self._v[layer_id]

    def _buffers(self, layer_id: int, k_buf: torch.Tensor,
                 moves: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's buffers at the planned capacity (grown, keeping their lanes and the lanes
        this step's ``moves`` read, if needed)."""
        mk = self._k.get(layer_id)
        if mk is not None and mk.shape[0] >= self._lanes_cap and self._v[layer_id].shape[2] >= self._s_cap:
            return mk, self._v[layer_id]
        _, hk, d = k_buf.shape
        if not self._k:  # the first buffer decides for all (every layer has the pool's dtype and head_dim)
            self.blocked = (self.blocked_keys and k_buf.dtype == torch.float32 and d % _VECTOR == 0
                            and self._s_cap % KEY_BLOCK == 0)
        k_shape = ((self._lanes_cap, hk, self._s_cap // KEY_BLOCK, d, KEY_BLOCK) if self.blocked
                   else (self._lanes_cap, hk, d, self._s_cap))
        v_shape = (self._lanes_cap, hk, self._s_cap, d)
        new_k, new_v = _zeros(k_shape, k_buf), _zeros(v_shape, k_buf)
        # What the new buffers hold after this step: the lanes in use (this step's token included:
        # copying its stale slot is harmless, the append overwrites it) and the lanes its moves read.
        self._touched = list(self._len)
        for src, _, length in moves:
            self._touch(src, length)
        if mk is not None:  # those positions move over, nothing else is touched
            old_v = self._v[layer_id]
            for lane, length in enumerate(self._touched[: old_v.shape[0]]):
                length = min(length, old_v.shape[2])
                if self.blocked:
                    blocks = -(-length // KEY_BLOCK)
                    new_k[lane, :, :blocks] = mk[lane, :, :blocks]
                else:
                    new_k[lane, :, :, :length] = mk[lane, :, :, :length]
                new_v[lane, :, :length] = old_v[lane, :, :length]
        self._lazy = k_buf.device.type == "cpu"
        self._token_bytes[layer_id] = 2 * hk * d * k_buf.element_size()
        self._k[layer_id], self._v[layer_id] = new_k, new_v
        self.generation += 1
        return new_k, new_v


def _zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A zero buffer of ``like``'s dtype and device; on the CPU from a fresh mapping in small pages
    (``common.hugepages.zeros``): zero without being written, so growing the mirror costs only what
    its lanes hold, not the whole capacity (``torch.zeros`` of 8 lanes x 2112 positions of
    SmolLM2's shape, 778 MB, took 1.6 s on a Zen 4 KVM guest: one decode step, every stream
    stalled, when a 2048-token request joined)."""
    if like.device.type == "cpu":
        return hugepages.zeros(shape, like.dtype, huge=False)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _blocks(positions: int) -> int:
    """Positions rounded up to whole key blocks: what a lane's writes make resident (a block of
    keys, 64 x head_dim floats, spans whole pages; values to the same length are close enough)."""
    return -(-positions // KEY_BLOCK) * KEY_BLOCK


def _grow(cap: int, need: int, align: int) -> int:
    """``cap`` if it holds ``need``, else max(2 x cap, need rounded up to ``align``)."""
    if need <= cap:
        return cap
    return max(2 * cap, -(-need // align) * align)
