"""The projections' layouts (common/models/linear.py): oneDNN-packed weights and our kernel's
blocked ones compute what F.linear computes, to float32 rounding, for any row count; the choice
follows device and dtype."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common import kernels
from common.models.linear import AUTO_MIN_ELEMENTS, BlockedWeight, linear, pack_linears, resolve_mode, splits_well


class Layer(nn.Module):
    PACKED_LINEARS = ("proj", "absent")

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(48, 32), requires_grad=False)
        self.absent = None  # an optional projection this layer does not have
        self.bias = nn.Parameter(torch.randn(48), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(32), requires_grad=False)  # not a projection: stays


@pytest.mark.parametrize("rows", [1, 3, 16, 257])
def test_packed_linear_equals_f_linear_for_any_row_count(rows: int) -> None:
    torch.manual_seed(rows)
    layer = Layer()
    plain = layer.proj.clone()
    x = torch.randn(rows, 32)
    want = torch.nn.functional.linear(x, plain, layer.bias)
    assert pack_linears(layer) == 1
    assert layer.proj.is_mkldnn and "proj" not in dict(layer.named_parameters())
    assert not layer.norm.is_mkldnn and layer.absent is None
    got = linear(x, layer.proj, layer.bias)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear(x[None], layer.proj), want[None] - layer.bias, rtol=1e-5, atol=1e-5)  # [1, T, in]
    assert torch.allclose(linear(x.t().contiguous().t(), layer.proj, layer.bias), want, rtol=1e-5, atol=1e-5)  # strided
    assert pack_linears(layer) == 0  # packing twice packs nothing


def test_auto_packs_only_weights_large_enough_to_stream() -> None:
    layer = Layer()
    assert pack_linears(layer, min_elements=48 * 32 + 1) == 0 and not layer.proj.is_mkldnn
    assert pack_linears(layer, min_elements=48 * 32) == 1 and layer.proj.is_mkldnn


def test_only_a_real_models_projections_split_well_over_cores() -> None:
    tiny, real = Layer(), Layer()
    real.proj = nn.Parameter(torch.randn(AUTO_MIN_ELEMENTS // 256, 256), requires_grad=False)
    assert not splits_well(tiny) and splits_well(real)
    pack_linears(tiny)
    pack_linears(real)  # the same in oneDNN's layout
    assert not splits_well(tiny) and splits_well(real)
    kernel = kernels.linear()
    if kernel is not None:  # and in ours
        layer = Layer()
        layer.proj = nn.Parameter(torch.randn(AUTO_MIN_ELEMENTS // 256, 256), requires_grad=False)
        pack_linears(layer, native=kernel)
        assert isinstance(layer.proj, BlockedWeight) and splits_well(layer)


def test_the_mode_follows_device_and_dtype() -> None:
    assert resolve_mode("auto", "cpu", torch.float32) == "auto"  # packed: ours where it builds, else oneDNN
    assert resolve_mode("auto", "cpu", torch.bfloat16) == "plain"
    assert resolve_mode("auto", "cuda:0", torch.float32) == "plain"
    assert resolve_mode("plain", "cpu", torch.float32) == "plain"
    with pytest.raises(ValueError, match="--cpu-linear packed"):
        resolve_mode("packed", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="--cpu-linear 'fast'"):
        resolve_mode("fast", "cpu", torch.float32)


def test_onednn_sees_a_bounded_set_of_row_counts_whatever_the_traffic(monkeypatch) -> None:
    # oneDNN keeps memory per row count for good: every row count must map onto the same few
    # shapes, padded by less than a quarter, with the results unchanged.
    from common.models import linear as mod

    seen: set[int] = set()
    real = mod._onednn

    def spy(x, weight, bias):
        seen.add(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(mod, "_onednn", spy)
    for m in range(1, mod.CHUNK_ROWS + 1):
        assert m <= mod.padded_rows(m) < m * 1.25 + 1
    w, b = torch.randn(8, 4), torch.randn(8)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for m in [*range(1, 700), 1023, 1100, 4097]:
        x = torch.randn(m, 4)
        assert torch.allclose(linear(x, packed, b), x @ w.T + b, rtol=1e-5, atol=1e-5), m
    assert len(seen) == 48 and max(seen) == mod.CHUNK_ROWS, sorted(seen)


needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C++ compiler to build our kernel with")


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (64, 20), (7, 5), (200, 96)])
def test_native_linear_equals_f_linear_for_any_row_count(out_features: int, in_features: int, threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Our kernel over its blocked layout: output columns in whole blocks of 32 and a last partial
    one, row counts around its 12-row tile (8 without AVX-512) and 128-row pass, a bias, strided and
    3-D inputs; a short last tile shared with the one before (16 -> 8 + 8, 28 -> 12 + 8 + 8 with
    AVX-512); and a row's result is the same, to the bit, alone and inside any batch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(out_features + in_features)
    w, b = torch.randn(out_features, in_features), torch.randn(out_features)
    kernel = kernels.linear()
    assert kernel is not None
    blocked = BlockedWeight(w, kernel)
    assert blocked.shape == w.shape and blocked.blocks.shape == (-(-out_features // 32), in_features, 32)
    for rows in (1, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 25, 26, 27, 28, 33, 40, 127, 128, 129, 300):
        x = torch.randn(rows, in_features)
        torch.testing.assert_close(linear(x, blocked, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, blocked), x @ w.T, rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 2 * in_features)[:, ::2]  # columns strided: copied first
    torch.testing.assert_close(linear(x, blocked, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(2 * in_features + 3)[3:].view(2, in_features)  # rows at an offset
    torch.testing.assert_close(linear(x, blocked, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, in_features)
    torch.testing.assert_close(linear(x, blocked, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert linear(torch.randn(0, in_features), blocked, b).shape == (0, out_features)
    batch = torch.randn(37, in_features)  # tiles of 12, 12, 13 (or 8, 8, 8, 8, 5)
    together = linear(batch, blocked, b)
    for i in (0, 11, 12, 30, 36):
        assert torch.equal(linear(batch[i:i + 1], blocked, b), together[i:i + 1])
    for rows in (16, 28):  # the last rows split between two tiles
        together = linear(batch[:rows], blocked, b)
        for i in (0, rows // 2 - 1, rows // 2, rows - 1):
            assert torch.equal(linear(batch[i:i + 1], blocked, b), together[i:i + 1])


@needs_compiler
def test_native_mode_packs_every_projection_once(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Layer()
    plain = layer.proj.clone()
    kernel = kernels.linear()
    assert resolve_mode("native", "cpu", torch.float32) == "native"
    assert pack_linears(layer, native=kernel) == 1
    assert isinstance(layer.proj, BlockedWeight) and "proj" not in dict(layer.named_parameters())
    assert pack_linears(layer, native=kernel) == 0  # packing twice packs nothing
    x = torch.randn(4, 32)
    torch.testing.assert_close(linear(x, layer.proj, layer.bias), torch.nn.functional.linear(x, plain, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_native_mode_without_the_kernel_falls_back_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "linear", lambda: None)
    assert resolve_mode("native", "cpu", torch.float32) == "auto"
    with pytest.raises(ValueError, match="--cpu-linear native"):
        resolve_mode("native", "cpu", torch.bfloat16)


def test_bench_projections_times_every_layout(tiny_model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    from common.tools import bench_projections as bench

    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    shapes = bench.projection_shapes(config)
    assert len(shapes) == 4 * config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]  # llama: absent
    assert shapes[0] == (
        (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim, config["hidden_size"])
    assert bench.main(["--model-path", tiny_model_dir, "--rows", "1,9", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    layouts = ["native", "packed", "plain"] if kernels.linear() is not None else ["packed", "plain"]
    assert lines[0].endswith("layouts: " + ", ".join(layouts))
    rows = [line.strip("|").split("|") for line in lines[3:]]
    assert [r[0].strip() for r in rows] == ["1", "9"]
    assert all(len(r) == 2 * len(layouts) and all(float(c.split()[0].rstrip("x")) > 0 for c in r[1:]) for r in rows)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied to the embedding / its own lm_head
def test_the_lm_head_in_our_layout_gives_the_same_embeddings_and_logits(tiny_model_factory, arch: str) -> None:
    from common.attention.torch_backend import TorchAttentionBackend
    from common.models import load_model
    from common.models.linear import pack_lm_head

    kernel = kernels.linear()
    if kernel is None:
        pytest.skip("no C++ compiler: our kernel cannot build")
    model = load_model(tiny_model_factory(arch), torch.float32, torch.device("cpu"), TorchAttentionBackend())
    tied = model.lm_head is None
    embed, head = model.embed_tokens.detach().clone(), (model.embed_tokens if tied else model.lm_head).detach().clone()
    assert pack_lm_head(model, kernel) and not pack_lm_head(model, kernel)  # once
    assert isinstance(model.embed_tokens, BlockedWeight) == tied and (tied or isinstance(model.lm_head, BlockedWeight))
    ids = torch.tensor([0, 1, 31, 32, 33, model.arch.vocab_size - 1, 7, 7])  # block edges, the last (padded) block
    assert torch.equal(model.embed(ids), torch.nn.functional.embedding(ids, embed))  # a lookup: exact
    hidden = torch.randn(5, model.arch.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), torch.nn.functional.linear(hidden, head), rtol=1e-5, atol=1e-5)
