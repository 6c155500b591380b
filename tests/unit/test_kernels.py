"""Our C++ decode-attention kernel (common/kernels/decode_attention.cpp) against a
float64 reference and against the torch-op path it replaces, over GQA groups 1-8, head_dims 16-128,
ragged lane lengths (1, around a vector's 16, up to the capacity), one and two threads, and
scores large enough to make most of a softmax underflow; and how the library is built, cached
and, when it cannot be, left out."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from common import kernels
from common.attention.base import AttentionLayerSpec
from common.attention.decode_mirror import KEY_BLOCK, MirrorPlan
from common.attention.torch_backend import TorchAttentionBackend, _one_query_attention

needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C++ compiler to build the kernel with")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> kernels.DecodeAttention:
    """The kernel built from source into a fresh directory (not a cache another run left)."""
    import ctypes

    return kernels.DecodeAttention(ctypes.CDLL(str(kernels.build("decode_attention", tmp_path_factory.mktemp("kernels")))))


def mirror(lanes: int, kv_heads: int, dim: int, s_cap: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole mirror buffers as decode_mirror.py lays them out, filled to the capacity (positions
    past a lane's length hold values the kernel must ignore)."""
    k = torch.randn(lanes, kv_heads, dim, s_cap, generator=gen)
    v = torch.randn(lanes, kv_heads, s_cap, dim, generator=gen)
    return k, v


def blocked(k: torch.Tensor) -> torch.Tensor:
    """Plain mirror keys [lanes, kv_heads, dim, s_cap] in blocks: [lanes, kv_heads, s_cap / 64, dim, 64]."""
    lanes, kv_heads, dim, s_cap = k.shape
    w = KEY_BLOCK
    return k.view(lanes, kv_heads, dim, s_cap // w, w).permute(0, 1, 3, 2, 4).contiguous()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Per lane and head in float64: softmax(q . K[:len] * scale) V[:len]."""
    b, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(b, heads, dim, dtype=torch.float64)
    for i, n in enumerate(lens):
        for h in range(heads):
            keys = k[i, h // group, :, :n].double()  # [dim, n]
            w = torch.softmax(q[i, h].double() @ keys * scale, dim=0)
            out[i, h] = w @ v[i, h // group, :n].double()
    return out


def ragged_plan(lens: list[int]) -> MirrorPlan:
    """A mirror plan of lanes in batch order with these lengths (the torch-op path masks by it)."""
    s = max(lens)
    return MirrorPlan(num_lanes=len(lens), max_seq=s, lanes=torch.arange(len(lens)), positions=torch.tensor(lens) - 1,
                      to_lane=None, from_lane=None, lane_lens=torch.tensor(lens, dtype=torch.int32),
                      mask=(torch.arange(s)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :], bias=None,
                      fills=[], moves=[], done_layers=set())


SHAPES = [  # heads, kv_heads, head_dim: SmolLM2, Qwen3-0.6B, Llama-3.2-1B, and groups of 1, 5 and 8
    (9, 3, 64), (16, 8, 128), (32, 8, 64), (4, 4, 16), (10, 2, 32), (8, 1, 16)]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_kernel_matches_float64_and_the_torch_ops(kernel: kernels.DecodeAttention, heads: int, kv_heads: int, dim: int,
                                                 threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(heads * 1000 + dim + threads)
    s_cap, lens = 192, [1, 15, 16, 17, 63, 100, 191, 192]
    k, v = mirror(len(lens) + 2, kv_heads, dim, s_cap, gen)  # two spare lanes past the batch
    q = torch.randn(len(lens), heads, dim, generator=gen)
    scale = dim**-0.5
    out = kernel(q, k, v, torch.tensor(lens, dtype=torch.int32), len(lens), scale)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, scale), rtol=1e-5, atol=2e-6)
    # The same keys in blocks: the same sums in the same order, so the same bits.
    assert kernels.DecodeAttention.supports(q, blocked(k))
    assert torch.equal(kernel(q, blocked(k), v, torch.tensor(lens, dtype=torch.int32), len(lens), scale), out)
    # The torch-op path on the same views (a mask for the ragged lengths): equal up to rounding.
    s = max(lens)
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, scale)
    ops = _one_query_attention(q, k[: len(lens), :, :, :s], v[: len(lens), :, :s], layer, ragged_plan(lens)).view_as(out)
    torch.testing.assert_close(out, ops, rtol=1e-5, atol=1e-6)


@needs_compiler
def test_sharp_softmax_underflows_to_zero_weights_not_nan(kernel: kernels.DecodeAttention) -> None:
    """Scores tens to hundreds apart: most weights are below e^-87 (where the kernel's exp clamps
    to 0) and a few keys dominate. Scores this large carry float32 rounding of their own (1e-5
    relative at 300), so the kernel is held to the torch-op path's error against float64, not to
    a fixed tolerance."""
    gen = torch.Generator().manual_seed(7)
    k, v = mirror(3, 3, 64, 256, gen)
    q = 40 * torch.randn(3, 9, 64, generator=gen)
    lens, scale = [256, 130, 33], 0.125
    out = kernel(q, k, v, torch.tensor(lens, dtype=torch.int32), 3, scale)
    assert torch.isfinite(out).all()
    exact = reference(q, k, v, lens, scale)
    ops = _one_query_attention(q, k, v, AttentionLayerSpec(0, 9, 3, 64, scale), ragged_plan(lens)).view_as(out)
    ops_err = (ops.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * ops_err + 1e-6


@needs_compiler
def test_build_is_cached_by_source_and_rebuilt_when_it_changes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = kernels.build("decode_attention", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert kernels.build("decode_attention", tmp_path) == first and first.stat().st_mtime_ns == stamp  # reused
    src = tmp_path / "src"
    src.mkdir()
    for header in kernels.SOURCE_DIR.glob("*.h"):
        (src / header.name).write_text(header.read_text())
    text = (kernels.SOURCE_DIR / "decode_attention.cpp").read_text()
    (src / "decode_attention.cpp").write_text(text + "\n// changed\n")
    monkeypatch.setattr(kernels, "SOURCE_DIR", src)
    second = kernels.build("decode_attention", tmp_path)
    assert second != first and second.exists()
    # A header the source includes is part of the key too.
    (src / "simd.h").write_text((src / "simd.h").read_text() + "\n// changed\n")
    third = kernels.build("decode_attention", tmp_path)
    assert third not in (first, second) and third.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary file left behind


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("PDC_KERNEL_CACHE_DIR", str(tmp_path))


def test_a_failing_build_warns_once_and_the_backend_keeps_torch_ops(fresh_loader: None, tmp_path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "decode_attention.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE_DIR", broken)
    if kernels._compiler() is None:
        monkeypatch.setenv("CXX", "g++-that-does-not-exist")
    with caplog.at_level(logging.WARNING, logger="common.kernels"):
        assert kernels.decode_attention() is None
        assert kernels.decode_attention() is None  # remembered, not retried per layer
        backend = TorchAttentionBackend(decode_mirror_bytes=1 << 20)
    assert backend.native_decode is None
    assert len([r for r in caplog.records if "runs on torch ops" in r.getMessage()]) == 1


def test_no_compiler_leaves_the_kernel_out(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    assert kernels.decode_attention() is None


def test_turned_off_by_env_builds_nothing(fresh_loader: None, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDC_NATIVE_KERNELS", "0")
    called = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: called.append(a))
    assert kernels.decode_attention() is None and not called
    assert TorchAttentionBackend(decode_mirror_bytes=1 << 20).native_decode is None


@needs_compiler
def test_backend_builds_only_the_kernels_it_runs(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = TorchAttentionBackend(decode_mirror_bytes=1 << 20, cpu=False)  # a GPU model: neither
    assert gpu.native_decode is None and gpu.native_prefill is None and kernels._loaded == {}
    no_mirror = TorchAttentionBackend()  # prefill's kernel only
    assert no_mirror.native_decode is None and no_mirror.native_prefill is not None
    assert set(kernels._loaded) == {"prefill_attention"}
    assert TorchAttentionBackend(decode_mirror_bytes=1 << 20).native_decode is not None


def test_bench_tool_times_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    from common.tools import bench_decode_attention as bench

    assert bench.main(["--lanes", "2", "--keys", "40", "--layers", "2", "--repeat", "2"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].strip("|").split("|")
    assert [c.strip() for c in row[:2]] == ["2", "40"] and float(row[2]) > 0
    if kernels.decode_attention() is not None:  # plain keys, blocked keys, ops / blocked
        assert float(row[4]) > 0 and float(row[6]) > 0 and row[8].strip().endswith("x")
