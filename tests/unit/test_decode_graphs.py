"""CUDA-graph decode's padding and buffers, on CPU: ``DecodeGraphs`` with ``EagerCapture`` (a
replay re-runs the captured function over the same fixed inputs and output buffer) against the
plain eager decode of an identical runner, step by step, for both archs.

What a real capture adds (fixed kernel addresses, the FlashInfer plan buffers) is checked on a GPU
by tests/gpu/test_cuda_graph.py; what this checks is everything around it: a batch of n runs at
the next captured size, padded entries write only the reserved page and state slot, the logits of
the real entries are the eager ones, and batches past the largest size fall back to eager.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from common.attention.base import AttentionLayerSpec
from common.attention.torch_backend import TorchAttentionBackend
from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve
from common.engine import model_runner as model_runner_mod
from common.engine.cuda_graph import DecodeGraphs, EagerCapture, capture_sizes
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.model_runner import DecodeItem, ExtendChunk, ModelRunner
from common.kvcache.pool import KVPool

PAGE = 4


class PlannedTorchBackend(TorchAttentionBackend):
    """The torch backend with the graph hooks: plans a padded decode batch from the host data the
    graph path passes (fresh tensors per plan are fine, since EagerCapture re-runs the forward)."""

    supports_cuda_graph = True

    def __init__(self) -> None:
        super().__init__(decode_mirror_bytes=0)
        self.graph_sizes: list[int] = []
        self.plans: list[tuple[int, list[int]]] = []

    def init_cuda_graphs(self, batch_sizes: Sequence[int], max_pages_per_req: int) -> None:
        self.graph_sizes = list(batch_sizes)

    def plan_decode_graph(self, bs: int, rows: torch.Tensor, seq_lens: Sequence[int], table: torch.Tensor,
                          layer: AttentionLayerSpec, kv_pool: KVPool, q_dtype: torch.dtype) -> Any:
        self.plans.append((bs, list(seq_lens)))
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        seq = list(seq_lens)
        batch = ForwardBatch(ForwardMode.DECODE, t([0] * bs), t([s - 1 for s in seq]), t([0] * bs), rows, t(seq),
                             t([s - 1 for s in seq]), t([1] * bs), table, kv_pool,
                             seq_lens_cpu=seq, prefix_lens_cpu=[s - 1 for s in seq], extend_lens_cpu=[1] * bs)
        self.init_forward_metadata(batch)
        return batch.attn_metadata


def build_runner(model_dir: str, monkeypatch: pytest.MonkeyPatch, graphs: bool) -> ModelRunner:
    cfg = resolve(NodeConfig(
        role="decode",
        model=ModelConfig(model_path=model_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(page_size=PAGE, max_total_tokens=4096, max_running_requests=12, enable_prefix_cache=False),
        attention=AttentionConfig(backend="torch", torch_decode_mirror_mib=0),
    ))
    if graphs:
        monkeypatch.setattr(model_runner_mod, "create_attention_backend", lambda *_: PlannedTorchBackend())
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    monkeypatch.undo()
    assert runner.graphs is None  # CPU: never captured on its own
    if graphs:
        runner.graphs = runner.capture_decode_graphs(AttentionConfig(cuda_graph_max_bs=8), 12, EagerCapture())
    return runner


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("arch", ["qwen3", "lfm2"])
def test_graph_decode_equals_eager_with_padding(tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
                                                arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    eager = build_runner(model_dir, monkeypatch, graphs=False)
    graph = build_runner(model_dir, monkeypatch, graphs=True)
    assert graph.graphs is not None and graph.graphs.sizes == [1, 2, 4, 8]
    backend = graph.attn_backend
    assert isinstance(backend, PlannedTorchBackend) and backend.graph_sizes == [1, 2, 4, 8]
    rng = random.Random(7)
    vocab = eager.arch.vocab_size
    n_reqs = 11  # past the largest captured size: the full batch must run eagerly
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))] for _ in range(n_reqs)]
    reqs: list[dict[str, Any]] = []
    for p in prompts:
        state: dict[str, Any] = {"len": len(p)}
        for name, runner in (("e", eager), ("g", graph)):
            kv = runner.memory.admit(p, use_cache=False)
            assert kv is not None and runner.memory.reserve(kv, len(p) + 40)
            state[name] = kv
        assert state["e"].row == state["g"].row
        reqs.append(state)
    chunks = [ExtendChunk(r["e"].row, p, 0) for r, p in zip(reqs, prompts)]
    for runner in (eager, graph):
        runner.extend(chunks)
    next_tok = [rng.randrange(3, vocab) for _ in range(n_reqs)]
    # Batches of 1, 3 (runs at 4), 5 (at 8), 8 and 11 (eager), over shifting subsets of requests.
    for step, n in enumerate([1, 3, 5, 8, 11, 3, 6, 2]):
        picked = sorted(rng.sample(range(n_reqs), n))
        items = [DecodeItem(reqs[i]["e"].row, next_tok[i], reqs[i]["len"]) for i in picked]
        plans_before = len(backend.plans)
        want = eager.decode(items)
        got = graph.decode(items)
        assert got.shape == want.shape == (n, vocab)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,  # batch shape changes matmul blocking
                                   msg=lambda m: f"step {step} (batch {n}): {m}")
        assert got.argmax(dim=-1).tolist() == want.argmax(dim=-1).tolist()
        if n <= 8:
            bs = graph.graphs.size_for(n)
            assert backend.plans[plans_before:] == [(bs, [reqs[i]["len"] + 1 for i in picked] + [1] * (bs - n))]
        else:
            assert len(backend.plans) == plans_before  # eager: no graph was planned
        for i, tok in zip(picked, want.argmax(dim=-1).tolist()):
            reqs[i]["len"] += 1
            next_tok[i] = tok
    # Every real request's KV (and recurrent state) is the eager runner's: padding wrote elsewhere.
    for r in reqs:
        slots = eager.req_to_token.table[r["e"].row, : r["len"]].long()
        for a, b in zip(eager.kv_pool.buffers(), graph.kv_pool.buffers()):
            torch.testing.assert_close(b[slots], a[slots])
        if eager.state_pool is not None:
            for a, b in zip(eager.state_pool.buffers, graph.state_pool.buffers):
                torch.testing.assert_close(b[r["g"].state_slot], a[r["e"].state_slot])
    # The padding went to page 0 / state slot 0, which the eager runner never touched.
    assert graph.kv_pool.k_buffers[0][:PAGE].abs().sum() > 0
    assert eager.kv_pool.k_buffers[0][:PAGE].abs().sum() == 0
    for runner in (eager, graph):
        for r in reqs:
            runner.memory.release(r["e"] if runner is eager else r["g"], None)
        runner.memory.check_integrity()


def test_graph_buffers_pad_with_the_pad_row(tiny_model_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = build_runner(tiny_model_factory("qwen3"), monkeypatch, graphs=True)
    graphs = runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    kv = runner.memory.admit([5, 6, 7], use_cache=False)
    assert kv is not None and runner.memory.reserve(kv, 8)
    runner.extend([ExtendChunk(kv.row, [5, 6, 7], 0)])
    out = graphs.run([9, 9, 9], [3, 3, 3], [kv.row] * 3)  # 3 entries run at size 4
    assert out.shape[0] == 3
    assert graphs.inputs[:, :4].tolist() == [[9, 9, 9, 0], [3, 3, 3, 0], [kv.row] * 3 + [runner.req_to_token.pad_row]]
    runner.memory.release(kv, None)
    runner.memory.check_integrity()
