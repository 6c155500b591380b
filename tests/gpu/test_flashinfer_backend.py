"""FlashInfer backend vs the torch backend on the same GPU batch (skipped without CUDA): extend
(ragged chunks, some over a cached prefix) and decode, page sizes 1 and 16, pages scattered."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from common.attention.base import AttentionLayerSpec  # noqa: E402
from common.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from common.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from common.engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from common.kvcache.pool import KVLayout, KVPool  # noqa: E402


def make_batch(mode: ForwardMode, pool: KVPool, table: torch.Tensor, prefix: list[int], ext: list[int]) -> ForwardBatch:
    dev = table.device
    rows = list(range(len(prefix)))
    pos = [p for pre, n in zip(prefix, ext) for p in range(pre, pre + n)]
    tok_rows = [r for r, n in zip(rows, ext) for _ in range(n)]
    out_loc = table[torch.tensor(tok_rows, device=dev), torch.tensor(pos, device=dev)].long()
    seq = [a + b for a, b in zip(prefix, ext)]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    return ForwardBatch(mode, t([0] * len(pos)), t(pos), out_loc, t(rows), t(seq), t(prefix), t(ext), table, pool, seq, prefix, ext)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_flashinfer_matches_torch(page_size: int, mode: ForwardMode) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    heads, kv_heads, d = 8, 2, 128
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=d, page_size=page_size, dtype="bfloat16")
    prefix = [0, 5, 40, 131] if mode is ForwardMode.EXTEND else [3, 17, 64, 250]
    ext = [7, 1, 33, 20] if mode is ForwardMode.EXTEND else [1, 1, 1, 1]
    num_pages = 200 if page_size == 16 else 3000
    outs = []
    for backend in (TorchAttentionBackend(), FlashInferAttentionBackend(dev)):
        pool = KVPool(layout, num_pages, dev)
        table = torch.zeros(len(prefix), 512, dtype=torch.int32, device=dev)
        per_req = max(-(-(p + n) // page_size) for p, n in zip(prefix, ext))  # pages the longest request needs
        perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1))[: len(prefix) * per_req] + 1
        for r, (p, n) in enumerate(zip(prefix, ext)):  # each request: its own scattered pages
            need = -(-(p + n) // page_size)
            pages = perm[r * per_req : r * per_req + need].to(dev)
            slots = (pages[:, None] * page_size + torch.arange(page_size, device=dev)[None, :]).reshape(-1)
            table[r, : slots.numel()] = slots.to(torch.int32)
        gen = torch.Generator(device=dev).manual_seed(2)
        pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen, device=dev))
        pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=gen, device=dev))
        batch = make_batch(mode, pool, table, prefix, ext)
        T = batch.num_tokens
        q = torch.randn(T, heads * d, generator=gen, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, kv_heads * d, generator=gen, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, kv_heads * d, generator=gen, device=dev, dtype=torch.bfloat16)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, k, v, AttentionLayerSpec(0, heads, kv_heads, d, d**-0.5), batch).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
