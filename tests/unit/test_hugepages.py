"""common/hugepages.py: large CPU buffers on a 2-MiB boundary, advised into huge pages."""
from __future__ import annotations

import gc

import pytest
import torch

from common import hugepages, kernels
from common.models.linear import BlockedWeight


def test_a_large_buffer_starts_on_a_huge_page_and_is_an_ordinary_tensor() -> None:
    t = hugepages.zeros((1024, 1024 + 3), torch.float32)
    assert t.shape == (1024, 1027) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()  # zero, as the kernel hands out fresh pages
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    assert t[1023, 1026].item() == t.numel() - 1
    half = hugepages.zeros((3, 1 << 20), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.data_ptr() % hugepages.HUGE_PAGE == 0


def test_a_view_keeps_the_mapping_alive_after_the_tensor_goes() -> None:
    t = hugepages.zeros((1 << 20,), torch.float32)
    t.fill_(7.0)
    tail = t[-4:]
    del t
    gc.collect()
    assert tail.tolist() == [7.0] * 4


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_small_page_buffer_takes_memory_only_where_written() -> None:
    """``huge=False`` (the decode mirror's buffers): zero everywhere, and what is never written
    never becomes resident, so growing a sparsely filled buffer costs only what it holds."""
    before = _resident_bytes()
    t = hugepages.zeros((64, 1 << 20), torch.float32, huge=False)  # 256 MiB
    assert t.shape == (64, 1 << 20) and t.is_contiguous() and t.dtype == torch.float32
    for row in range(0, 64, 8):
        t[row, :1024] = 1.0  # 4 KiB in each of 8 rows
    assert t.sum().item() == 8 * 1024  # the rest reads as zero
    assert _resident_bytes() - before < 32 << 20, "the unwritten pages became resident"


def test_a_small_buffer_is_a_plain_tensor() -> None:
    t = hugepages.zeros((16, 16), torch.float32)
    assert t.shape == (16, 16) and t.dtype == torch.float32


@pytest.mark.skipif(kernels.linear() is None, reason="no C++ compiler for the native kernel")
def test_packed_weights_live_in_huge_pages() -> None:
    w = torch.randn(1024, 576)
    blocked = BlockedWeight(w, kernels.linear())
    assert blocked.blocks.data_ptr() % hugepages.HUGE_PAGE == 0
    x = torch.randn(3, 576)
    torch.testing.assert_close(blocked(x, None), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(kernels.linear() is None, reason="no C++ compiler for the native kernel")
def test_a_models_packed_projections_share_one_arena_of_huge_pages() -> None:
    # One buffer for all: each in its own would leave tails (and a whole 1.3-MB projection) in small pages.
    from torch import nn

    from common.models.linear import pack_linears

    class Layer(nn.Module):
        PACKED_LINEARS = ("a", "b", "c")

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(100, 576), requires_grad=False)  # 100 columns: padded to 128
            self.b = nn.Parameter(torch.randn(576, 576), requires_grad=False)  # 1.3 MB, under a huge page
            self.c = nn.Parameter(torch.randn(2000, 576), requires_grad=False)

    model = nn.Sequential(Layer(), Layer())
    plain = {name: p.clone() for name, p in model.named_parameters()}
    kernel = kernels.linear()
    assert pack_linears(model, native=kernel) == 6
    blocked = [getattr(layer, n) for layer in model for n in Layer.PACKED_LINEARS]
    assert all(isinstance(w, BlockedWeight) for w in blocked) and not list(model.parameters())
    first = blocked[0].blocks.data_ptr()
    assert first % hugepages.HUGE_PAGE == 0
    ends = [first]  # back to back, in model order
    for w in blocked:
        assert w.blocks.data_ptr() == ends[-1]
        ends.append(w.blocks.data_ptr() + w.blocks.numel() * 4)
    x = torch.randn(5, 576)
    for i, layer in enumerate(model):
        for n in Layer.PACKED_LINEARS:
            torch.testing.assert_close(getattr(layer, n)(x, None), x @ plain[f"{i}.{n}"].T, rtol=1e-4, atol=1e-4)
