"""CUDA-graph decode on a GPU: replayed graphs (FlashInfer, bf16) against eager decode of an
identical runner, step by step, with padded batches and a batch past the largest captured size;
the real request KV must match too (padding writes only the reserved page). Skipped without CUDA
or flashinfer. The CPU twin (tests/unit/test_decode_graphs.py) checks the same padding logic
without a capture."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve  # noqa: E402
from common.engine.cuda_graph import DecodeGraphs  # noqa: E402
from common.engine.model_runner import DecodeItem, ExtendChunk, ModelRunner  # noqa: E402

HEAD_DIM = 128  # one FlashInfer JIT module (bf16, head_dim 128) serves every GPU test
NEAR_TIE = 0.5  # logit units: two bf16 steps at |logits| of 32-64 (tiny models' logits have a std of ~8)


def gpu_runner(model_dir: str, graphs: bool, page_size: int) -> ModelRunner:
    cfg = resolve(NodeConfig(
        role="decode",
        model=ModelConfig(model_path=model_dir, device="cuda", dtype="bfloat16"),
        cache=CacheConfig(page_size=page_size, max_total_tokens=16384, max_running_requests=24, enable_prefix_cache=False),
        attention=AttentionConfig(backend="flashinfer", cuda_graph_max_bs=16, disable_cuda_graph=not graphs),
    ))
    return ModelRunner(cfg.model, cfg.cache, cfg.attention)


@pytest.mark.parametrize("arch,page_size", [("qwen3", 16), ("qwen3", 1), ("lfm2", 16)])
def test_graph_replay_equals_eager(tiny_model_factory: Callable[..., str], arch: str, page_size: int) -> None:
    model_dir = tiny_model_factory(arch, head_dim=HEAD_DIM)
    eager, graph = gpu_runner(model_dir, False, page_size), gpu_runner(model_dir, True, page_size)
    assert eager.graphs is None
    assert isinstance(graph.graphs, DecodeGraphs) and graph.graphs.sizes == [1, 2, 4, 8, 16]
    rng = random.Random(3)
    vocab = eager.arch.vocab_size
    n_reqs = 20
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 300))] for _ in range(n_reqs)]
    kvs = []
    for p in prompts:
        pair = []
        for runner in (eager, graph):
            kv = runner.memory.admit(p, use_cache=False)
            assert kv is not None and runner.memory.reserve(kv, len(p) + 64)
            pair.append(kv)
        assert pair[0].row == pair[1].row
        kvs.append(pair)
    lens = [len(p) for p in prompts]
    for runner in (eager, graph):
        runner.extend([ExtendChunk(kv[0].row, p, 0) for kv, p in zip(kvs, prompts)])
    nxt = [rng.randrange(3, vocab) for _ in range(n_reqs)]
    # A padded batch runs other GEMM shapes than the eager one (cuBLAS picks per shape), so bf16
    # logits differ in rounding: compared relative to their scale, and greedy picks must agree
    # except at a near-tie of the eager logits.
    for step, n in enumerate([1, 3, 5, 16, 20, 7, 12, 2, 9, 16]):  # 20: past 16, eager in both
        picked = sorted(rng.sample(range(n_reqs), n))
        items = [DecodeItem(kvs[i][0].row, nxt[i], lens[i]) for i in picked]
        want, got = eager.decode(items), graph.decode(items)
        assert torch.isfinite(got).all()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2e-2, f"step {step} (batch {n}): graph logits off by {err:.3g} of their scale"
        top2 = want.topk(2, dim=-1).values
        for j, (a, b) in enumerate(zip(want.argmax(-1).tolist(), got.argmax(-1).tolist())):
            gap = float(top2[j, 0] - top2[j, 1])
            assert a == b or gap <= NEAR_TIE, f"step {step} row {j}: eager {a}, graph {b}, eager top-2 gap {gap:.3g}"
        for i, t in zip(picked, want.argmax(-1).tolist()):
            lens[i] += 1
            nxt[i] = t
    for (kv_e, kv_g), n in zip(kvs, lens):
        slots = eager.req_to_token.table[kv_e.row, :n].long()
        for a, b in zip(eager.kv_pool.buffers(), graph.kv_pool.buffers()):
            err = float((b[slots].float() - a[slots].float()).abs().max() / a[slots].float().abs().max())
            assert err < 2e-2, f"KV of row {kv_e.row} off by {err:.3g} of its scale"
    for runner, col in ((eager, 0), (graph, 1)):
        for pair in kvs:
            runner.memory.release(pair[col], None)
        runner.memory.check_integrity()


def test_capture_makes_replay_independent_of_python(tiny_model_factory: Callable[..., str]) -> None:
    """A replay reads only the graph's buffers: the same inputs give the same logits on two replays
    with other batches in between, and the eager forward of the same step agrees."""
    runner = gpu_runner(tiny_model_factory("qwen3", head_dim=HEAD_DIM), True, 16)
    graphs = runner.graphs
    assert graphs is not None and isinstance(graphs._replay[1].__self__, torch.cuda.CUDAGraph)  # a real capture
    kv = runner.memory.admit(list(range(3, 40)), use_cache=False)
    assert kv is not None and runner.memory.reserve(kv, 64)
    runner.extend([ExtendChunk(kv.row, list(range(3, 40)), 0)])
    first = graphs.run([7], [37], [kv.row])
    graphs.run([8, 9, 10], [37, 37, 37], [kv.row] * 3)  # rewrites slot 37 with other tokens ...
    again = graphs.run([7], [37], [kv.row])  # ... and back
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    runner.memory.release(kv, None)
    runner.memory.check_integrity()
