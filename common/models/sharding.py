"""Which slice of each weight one tensor-parallel rank holds (Megatron-style sharding).

    column-parallel (output rows split):  fused q/k/v, fused gate/up
    row-parallel (input columns split):   o_proj, down_proj  -> partial sums, all-reduced
    replicated:                           embedding, lm_head, every norm, q/k norms, biases
                                          added after a row-parallel all-reduce

Heads. With ``H`` query heads, ``KV`` KV heads and ``tp`` ranks, rank ``r`` holds query heads
``[r*H/tp, (r+1)*H/tp)`` and::

    tp <= KV:  KV heads [r*KV/tp, (r+1)*KV/tp)             (each KV head on exactly one rank)
    tp >  KV:  KV head  r // (tp/KV), one replicated copy   (tp/KV ranks hold the same head)

Query head ``h`` reads KV head ``h // (H/KV)`` (GQA); both rules keep that KV head on the rank of
its query heads, so attention needs no communication. Counts that do not divide are refused by
``attention_shard`` with the numbers in the message.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ShardingError(ValueError):
    """A model that cannot be split over the requested number of ranks; the message says why."""


@dataclass(frozen=True)
class AttentionShard:
    """The heads one rank holds (global head indices, contiguous ranges)."""

    rank: int
    tp_size: int
    q_head_start: int
    num_heads: int  # query heads on this rank
    kv_head_start: int
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_replicas: int  # ranks holding each of this rank's KV heads (1: not replicated)


def attention_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> AttentionShard:
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ShardingError(f"tp rank {rank} is not in [0, tp size {tp_size})")
    if num_heads % tp_size:
        raise ShardingError(f"num_attention_heads {num_heads} is not divisible by tp size {tp_size}")
    if num_heads % num_kv_heads:
        raise ShardingError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    local_q = num_heads // tp_size
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ShardingError(f"num_key_value_heads {num_kv_heads} is not divisible by tp size {tp_size}")
        local_kv = num_kv_heads // tp_size
        return AttentionShard(rank, tp_size, rank * local_q, local_q, rank * local_kv, local_kv, 1)
    if tp_size % num_kv_heads:
        raise ShardingError(f"tp size {tp_size} is larger than num_key_value_heads {num_kv_heads} "
                            f"but not a multiple of it, so KV heads cannot be replicated evenly")
    replicas = tp_size // num_kv_heads
    return AttentionShard(rank, tp_size, rank * local_q, local_q, rank // replicas, 1, replicas)


def split_size(size: int, tp_size: int, what: str) -> int:
    """``size / tp_size`` for a column- or row-parallel dimension, or a ShardingError naming it."""
    if size % tp_size:
        raise ShardingError(f"{what} {size} is not divisible by tp size {tp_size}")
    return size // tp_size


@dataclass(frozen=True)
class ShardTarget:
    """Fill ``dest`` with the slice ``[start, start + dest.shape[dim])`` along ``dim`` of a
    checkpoint tensor whose size along ``dim`` is ``full`` (the loader reads only that slice)."""

    dest: torch.Tensor
    dim: int
    start: int
    full: int

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.dest.shape)
        shape[self.dim] = self.full
        return tuple(shape)

    @property
    def stop(self) -> int:
        return self.start + self.dest.shape[self.dim]


def rows(dest: torch.Tensor, start: int, full: int) -> ShardTarget:
    """A slice of a checkpoint tensor's rows (dim 0): column-parallel weights, their biases."""
    return ShardTarget(dest, 0, start, full)


def cols(dest: torch.Tensor, start: int, full: int) -> ShardTarget:
    """A slice of a checkpoint tensor's columns (dim 1): row-parallel weights."""
    return ShardTarget(dest, 1, start, full)
