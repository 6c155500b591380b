"""Tensor-parallel sharding in one process: which heads each rank holds, what the loader reads,
what is refused, and each rank's CPU share. (The multi-process engine runs are in test_tp_engine.)"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open

from common.attention.torch_backend import TorchAttentionBackend
from common.cpu_budget import CpuConfig
from common.models import ModelArchConfig, load_model
from common.models.sharding import ShardingError, attention_shard
from common.parallel import SINGLE_RANK, SingleRank, TPGroup, init_tp_group, rank_cpu_config, rank_device


class FakeRank(SingleRank):
    """A rank of a group that is never asked to communicate (loading and shapes only)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:  # type: ignore[override]
        raise AssertionError("no collective expected while loading")


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 2), (8, 8), (8, 1), (32, 8)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_head_ranges_partition_queries_and_keep_gqa_groups_local(heads: int, kv_heads: int, tp: int) -> None:
    group = heads // kv_heads  # query heads per KV head (GQA)
    shards = [attention_shard(heads, kv_heads, tp, r) for r in range(tp)]
    # Query heads: contiguous, disjoint, together all of them, the same count on every rank.
    covered = [h for s in shards for h in range(s.q_head_start, s.q_head_start + s.num_heads)]
    assert covered == list(range(heads))
    assert {s.num_heads for s in shards} == {heads // tp}
    for s in shards:
        held = set(range(s.kv_head_start, s.kv_head_start + s.num_kv_heads))
        needed = {h // group for h in range(s.q_head_start, s.q_head_start + s.num_heads)}
        assert needed == held, f"rank {s.rank}: query heads need KV heads {needed}, rank holds {held}"
    if tp <= kv_heads:
        assert all(s.num_kv_heads == kv_heads // tp and s.kv_replicas == 1 for s in shards)
        assert sorted(s.kv_head_start for s in shards) == list(range(0, kv_heads, kv_heads // tp))
    else:  # replication: one head per rank, head rank // (tp // kv_heads), each on tp/kv ranks
        assert [s.kv_head_start for s in shards] == [r // (tp // kv_heads) for r in range(tp)]
        assert all(s.num_kv_heads == 1 and s.kv_replicas == tp // kv_heads for s in shards)


def test_replication_table_tp4_two_kv_heads() -> None:
    got = [(s.q_head_start, s.num_heads, s.kv_head_start) for s in (attention_shard(8, 2, 4, r) for r in range(4))]
    assert got == [(0, 2, 0), (2, 2, 0), (4, 2, 1), (6, 2, 1)]


@pytest.mark.parametrize("heads,kv_heads,tp,message", [
    (9, 3, 2, "num_attention_heads 9 is not divisible by tp size 2"),
    (12, 6, 4, "num_key_value_heads 6 is not divisible by tp size 4"),
    (12, 4, 6, "tp size 6 is larger than num_key_value_heads 4 but not a multiple of it"),
])
def test_indivisible_head_counts_are_refused_with_the_numbers(heads: int, kv_heads: int, tp: int, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        attention_shard(heads, kv_heads, tp, 0)


def test_kv_layout_holds_the_rank_heads_only(tiny_model_factory: Callable[..., str]) -> None:
    arch = ModelArchConfig.from_model_dir(tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=4))
    assert arch.kv_layout(16, "float32").num_kv_heads == 4
    assert [arch.kv_layout(16, "float32", 2, r).num_kv_heads for r in range(2)] == [2, 2]
    assert [arch.kv_layout(16, "float32", 8, r).num_kv_heads for r in range(8)] == [1] * 8
    one = arch.kv_layout(16, "float32", 2, 0)
    assert one.bytes_per_page_per_layer * 2 == arch.kv_layout(16, "float32").bytes_per_page_per_layer


def _stored(path: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("tp,rank", [(2, 1), (4, 2)])
def test_loader_fills_each_rank_with_its_slices(tiny_model_factory: Callable[..., str], tp: int, rank: int) -> None:
    """Every parameter of a rank equals the checkpoint tensor's rows/columns that rank owns
    (qkv/o per head, gate/up/down per MLP column, biases included, norms and embedding whole)."""
    path = tiny_model_factory("llama", num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    ref = _stored(path)
    model = load_model(path, "float32", "cpu", TorchAttentionBackend(), FakeRank(rank, tp))
    a = model.arch
    d, inter = a.head_dim, a.intermediate_size // tp
    s = attention_shard(a.num_heads, a.num_kv_heads, tp, rank)
    qs, ks = slice(s.q_head_start * d, (s.q_head_start + s.num_heads) * d), slice(s.kv_head_start * d, (s.kv_head_start + s.num_kv_heads) * d)
    ms = slice(rank * inter, (rank + 1) * inter)
    assert torch.equal(model.embed_tokens, ref["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head, ref["lm_head.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        want_qkv = torch.cat([ref[p + "self_attn.q_proj.weight"][qs], ref[p + "self_attn.k_proj.weight"][ks],
                              ref[p + "self_attn.v_proj.weight"][ks]])
        assert torch.equal(attn.qkv_proj, want_qkv)
        want_bias = torch.cat([ref[p + "self_attn.q_proj.bias"][qs], ref[p + "self_attn.k_proj.bias"][ks],
                               ref[p + "self_attn.v_proj.bias"][ks]])
        assert torch.equal(attn.qkv_bias, want_bias)
        assert torch.equal(attn.o_proj, ref[p + "self_attn.o_proj.weight"][:, qs])
        assert torch.equal(attn.o_bias, ref[p + "self_attn.o_proj.bias"])  # whole: added once after the sum
        assert torch.equal(mlp.gate_up_proj, torch.cat([ref[p + "mlp.gate_proj.weight"][ms], ref[p + "mlp.up_proj.weight"][ms]]))
        assert torch.equal(mlp.gate_up_bias, torch.cat([ref[p + "mlp.gate_proj.bias"][ms], ref[p + "mlp.up_proj.bias"][ms]]))
        assert torch.equal(mlp.down_proj, ref[p + "mlp.down_proj.weight"][:, ms])
        assert torch.equal(mlp.down_bias, ref[p + "mlp.down_proj.bias"])
        assert torch.equal(layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])
        assert attn.spec.num_heads == s.num_heads and attn.spec.num_kv_heads == s.num_kv_heads


def test_tp1_loads_whole_tensors(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=4)
    ref = _stored(path)
    model = load_model(path, "float32", "cpu", TorchAttentionBackend(), SINGLE_RANK)
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj[: q.shape[0]], q)
    assert torch.equal(model.layers[1].self_attn.o_proj, ref["model.layers.1.self_attn.o_proj.weight"])


def test_indivisible_mlp_width_and_lfm2_are_refused(tiny_model_factory: Callable[..., str]) -> None:
    odd = tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=4, intermediate_size=130)
    with pytest.raises(ShardingError, match="intermediate_size 130 is not divisible by tp size 4"):
        load_model(odd, "float32", "cpu", TorchAttentionBackend(), FakeRank(0, 4))
    with pytest.raises(ShardingError, match=r"Lfm2ForCausalLM does not support tensor parallelism \(tp size 2\)"):
        load_model(tiny_model_factory("lfm2"), "float32", "cpu", TorchAttentionBackend(), FakeRank(0, 2))


def test_single_rank_collectives_are_the_identity() -> None:
    t = torch.arange(4.0)
    group: TPGroup = SINGLE_RANK
    assert group.all_reduce(t) is t and group.broadcast(t) is t
    assert group.is_first and group.size == 1
    assert init_tp_group(0, 1, "tcp://127.0.0.1:1") is SINGLE_RANK  # tp = 1 never touches torch.distributed


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match=f"tp rank {rank} is not in"):
        init_tp_group(rank, size, "tcp://127.0.0.1:1")


@pytest.mark.parametrize("cpu,size,want", [
    (CpuConfig(threads=8, bind=tuple(range(8))), 2, [CpuConfig(4, (0, 1, 2, 3)), CpuConfig(4, (4, 5, 6, 7))]),
    (CpuConfig(threads=2, bind=(0, 1)), 4, [CpuConfig(1, (0,)), CpuConfig(1, (1,)), CpuConfig(1, (0,)), CpuConfig(1, (1,))]),
    (CpuConfig(threads=6), 4, [CpuConfig(1)] * 4),
    (CpuConfig(threads=8), 2, [CpuConfig(4)] * 2),
])
def test_each_rank_gets_its_share_of_the_cpu_budget(cpu: CpuConfig, size: int, want: list[CpuConfig]) -> None:
    assert [rank_cpu_config(cpu, r, size) for r in range(size)] == want
    assert rank_cpu_config(cpu, 0, 1) == cpu


def test_rank_device() -> None:
    assert [rank_device("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda", 0, 1) == "cuda" and rank_device("cpu", 1, 2) == "cpu"
