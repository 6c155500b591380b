"""KV page digests of a pool on CUDA (the batched path: gathered, copied once, hashed by threads)
equal the host path's over the same bytes on CPU, so GPU and CPU nodes of one cluster agree, and
a changed byte on the GPU is caught. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from common.kvcache.page_digest import PageDigests, digest_key  # noqa: E402
from common.kvcache.pool import KVLayout, KVPool  # noqa: E402


def test_gpu_digests_equal_cpu_digests() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    gpu = KVPool(layout, 300, "cuda")
    for buf in gpu.buffers():
        buf.copy_(torch.randn(buf.shape, device="cuda"))
    cpu = KVPool(layout, 300, "cpu")
    for a, b in zip(cpu.buffers(), gpu.buffers()):
        a.copy_(b.cpu())
    key = digest_key("secret")
    dg, dc = PageDigests(gpu.buffers(), 16, 300, key), PageDigests(cpu.buffers(), 16, 300, key)
    assert dg._batched and not dc._batched
    pages = list(range(250, 1, -3))
    assert dg.compute_many(pages, valid_last=5) == dc.compute_many(pages, valid_last=5)
    dg.record(pages)
    assert dg.first_mismatch(pages) is None
    gpu.v_buffers[3][pages[10] * 16 + 15, 7, 127] += 1
    assert dg.first_mismatch(pages) == 10
