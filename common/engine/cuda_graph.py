"""Decode forwards replayed from CUDA graphs.

A decode step of a small model is a few hundred small kernels; launched one by one from Python,
the GPU waits on the host between them and a step costs several times its memory traffic. A
captured graph launches the whole forward (embedding to logits) at once.

Sizes. Batch sizes 1, 2, 4, 8, then every 8 up to ``--cuda-graph-max-bs`` (and never past
``--max-running-requests``) are captured. A batch of ``n`` requests runs the smallest captured
size ``bs >= n``; the ``bs - n`` extra entries are padding: token 0 at position 0 of the pad row
(``ReqToTokenPool.pad_row``), which the table maps to slot 0 of the reserved page 0 and
``row_state`` to the reserved state slot 0, so their K/V and state writes land where no request
lives, and their logits are dropped. A batch larger than the largest size runs eagerly.

What stays fixed. Captured kernels read fixed addresses, so the step's inputs live in one buffer
``inputs`` [3, max_bs] (token ids, positions, rows), written by one host-to-device copy per step.
Everything else the forward needs is computed inside the graph from it (the new token's KV slot
from the table, sequence lengths, hybrid models' state slots), except the attention metadata,
which the backend plans on the host before each replay into buffers the graph reads
(``plan_decode_graph``; the FlashInfer backend supports it). The logits buffer of each size is
the graph's own; ``run`` returns a copy, so a caller may keep it past the next step.

Lifecycle. Built once by the model runner after the weights and pools exist: each size is
planned for all-padding, run once eagerly (lazy first-call work, such as a JIT module's load or
a cuBLAS handle, must not happen under capture) and captured, largest first, all sizes sharing
one memory pool. ``GraphCapture`` is the seam: ``CudaGraphCapture`` on a GPU, ``EagerCapture``
(re-runs the function on replay) so the padding and buffer logic is tested on CPU.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from common.attention.base import AttentionBackend, AttentionLayerSpec
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.kvcache.pool import KVPool
from common.kvcache.req_to_token import ReqToTokenPool
from common.kvcache.state_pool import StatePool

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_bs``, which is always included."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``fn``; returns (replay, the output tensor every replay rewrites)."""


class CudaGraphCapture:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # one pool: sizes captured largest first share it
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.synchronize(self.device)
        return graph.replay, out


class EagerCapture:
    """Replay runs the function again and writes its result into the first output: the graph's
    contract (fixed inputs in, fixed output buffer out) without CUDA."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()

        def replay() -> None:
            out.copy_(fn())

        return replay, out


class DecodeGraphs:
    def __init__(self, model: Any, backend: AttentionBackend, layer: AttentionLayerSpec, kv_pool: KVPool,
                 req_to_token: ReqToTokenPool, row_state: torch.Tensor, state_pool: StatePool | None,
                 batch_sizes: Sequence[int], dtype: torch.dtype, capture: GraphCapture) -> None:
        """``model``: forward(ForwardBatch) -> hidden and compute_logits(hidden) -> logits;
        ``layer``: the attention shape every attention layer shares (what the backend plans for);
        ``row_state``: request row -> state slot (``KVMemory.row_state``)."""
        self.model, self.backend, self.layer, self.dtype = model, backend, layer, dtype
        self.kv_pool, self.req_to_token, self.row_state, self.state_pool = kv_pool, req_to_token, row_state, state_pool
        self.sizes = sorted(set(batch_sizes))
        dev = req_to_token.device
        most = self.sizes[-1]
        self.pad_row = req_to_token.pad_row
        self.inputs = torch.zeros(3, most, dtype=torch.int64, device=dev)  # token ids, positions, rows
        self.inputs[2].fill_(self.pad_row)
        self._ones = torch.ones(most, dtype=torch.int64, device=dev)
        max_pages = -(-req_to_token.max_context_len // kv_pool.page_size)
        backend.init_cuda_graphs(self.sizes, max_pages)  # type: ignore[attr-defined]
        self._meta: dict[int, Any] = {}
        self._replay: dict[int, Callable[[], None]] = {}
        self._out: dict[int, torch.Tensor] = {}
        for bs in reversed(self.sizes):
            self._plan(bs, [1] * bs)  # all padding
            self._forward(bs)  # warm-up, outside capture
            self._replay[bs], self._out[bs] = capture.capture(lambda bs=bs: self._forward(bs))
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, n: int) -> bool:
        return 1 <= n <= self.sizes[-1]

    def size_for(self, n: int) -> int:
        """The captured size a batch of ``n`` runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int], positions: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """One decode step: token ``input_ids[i]`` at ``positions[i]`` of request row ``rows[i]``
        (its slot there already reserved). Returns next-token logits. [n, vocab] float32"""
        n = len(input_ids)
        bs = self.size_for(n)
        pad = bs - n
        host = torch.tensor([[*input_ids, *[0] * pad], [*positions, *[0] * pad], [*rows, *[self.pad_row] * pad]],
                            dtype=torch.int64)  # [3, bs]
        self.inputs[:, :bs].copy_(host)
        self._plan(bs, [p + 1 for p in positions] + [1] * pad)
        self._replay[bs]()
        return self._out[bs][:n].clone()

    def _plan(self, bs: int, seq_lens: list[int]) -> None:
        self._meta[bs] = self.backend.plan_decode_graph(  # type: ignore[attr-defined]
            bs, self.inputs[2, :bs], seq_lens, self.req_to_token.table, self.layer, self.kv_pool, self.dtype)

    def _forward(self, bs: int) -> torch.Tensor:
        """The captured function: logits of the first ``bs`` entries of ``inputs``. [bs, vocab]"""
        ids, pos, rows = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        table = self.req_to_token.table
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=ids, positions=pos,
            out_cache_loc=table[rows, pos].long(),  # each new token's slot, reserved by the scheduler
            req_pool_indices=rows, seq_lens=pos + 1, prefix_lens=pos, extend_lens=self._ones[:bs],
            req_to_token=table, kv_pool=self.kv_pool, state_pool=self.state_pool,
            state_slots=None if self.state_pool is None else self.row_state[rows],
            attn_metadata=self._meta[bs],
        )
        return self.model.compute_logits(self.model.forward(batch))
