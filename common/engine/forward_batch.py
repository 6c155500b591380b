"""The tensors one forward step needs, built by the engine driver and read by attention backends.

A batch is either all EXTEND (prefill chunks: each request appends ``extend_len`` tokens after
``prefix_len`` tokens already in the KV pool) or all DECODE (each request appends one token).
Tokens of all requests are packed back to back::

    input_ids:  [r0 t0 t1 t2 | r1 t0 | r2 t0 t1]      extend_lens = [3, 1, 2]
    seq_lens:   prefix_len + extend_len per request    (length of the KV after this step)
    out_cache_loc: the KV slot each new token's K/V is written to

``req_to_token[req_pool_indices[i], :seq_lens[i]]`` lists request i's KV slots in position order,
including the new ones (the driver fills them before the forward). Hybrid models also read and
update each request's recurrent state in ``state_pool`` at ``state_slots``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.kvcache.pool import KVPool
    from common.kvcache.state_pool import StatePool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    prefix_lens: torch.Tensor  # [B] int64, KV length before this step
    extend_lens: torch.Tensor  # [B] int64, tokens appended this step (all 1 in DECODE)
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32 slot table (the pool's, not a copy)
    kv_pool: "KVPool"
    # CPU copies for backends that loop or plan on the host.
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    rows_cpu: list[int] = field(default_factory=list)  # req_pool_indices
    # Each row's allocation count (ReqToTokenPool.epoch): a backend that keeps per-request state
    # across steps (the torch decode mirror) knows a reused row for a new request by it.
    row_epochs: list[int] = field(default_factory=list)
    # Hybrid models: each request's recurrent-state slot ([B] int64) in ``state_pool``.
    state_pool: "StatePool | None" = None
    state_slots: torch.Tensor | None = None
    # Set by the attention backend's init_forward_metadata(); opaque to everyone else.
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index into the packed tokens of each request's last new token. [B] int64."""
        return torch.cumsum(self.extend_lens, dim=0) - 1
