"""The tensor-parallel group of one node: its ranks, and the collectives the engine needs.

    TPGroup                rank, size, all_reduce, broadcast, broadcast_bytes, barrier, close
      SingleRank           tp = 1: every collective returns its input; nothing is imported or
                           synchronised, so the tp = 1 hot path costs one attribute check
      DistTPGroup          tp > 1: one torch.distributed process group (gloo on CPU, NCCL on CUDA)
    init_tp_group(rank, size, init_method, device) -> TPGroup
    rank_cpu_config(cpu, rank, size) -> CpuConfig         each rank's share of the node's cores
    rank_device(device, rank, size) -> str                "cuda" -> "cuda:<rank>" for tp > 1

Every rank of a node is one process. All ranks run the same scheduler on the same inputs, so they
issue the same collectives in the same order; a collective one rank skips hangs the others until
the group's timeout, which is why the engine calls them only from code every rank runs
unconditionally (the layers' forward, the driver's sampling step).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Literal

import torch

from common.cpu_budget import CpuConfig, allowed_cpus

log = logging.getLogger(__name__)

ReduceOp = Literal["sum", "min", "max"]
DEFAULT_TIMEOUT_S = 300.0  # a rank that waits this long for its peers raises instead of hanging


class TPGroup(ABC):
    rank: int
    size: int
    device: torch.device = torch.device("cpu")  # where collectives' tensors must live (NCCL: the GPU)

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank whose sampled tokens are authoritative and that talks to the API."""
        return self.rank == 0

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the ranks, in place; returns it (every rank gets the result)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s, in place; returns it. Shapes and
        dtypes must agree on all ranks."""

    @abstractmethod
    def barrier(self) -> None: ...

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``src``'s bytes on every rank (others pass None): the way a rank-0 decision that is not
        a tensor (e.g. a step's encoded input messages) reaches the other ranks. Two
        broadcasts: the length, then the payload."""
        if self.size == 1:
            assert data is not None
            return data
        mine = data if self.rank == src and data is not None else b""
        length = torch.tensor([len(mine)], dtype=torch.int64, device=self.device)
        self.broadcast(length, src)  # [1]
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)  # [n]
        if mine:
            buf.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
        if buf.numel():
            self.broadcast(buf, src)
        return buf.cpu().numpy().tobytes()

    def close(self) -> None:
        """Leave the group (idempotent)."""


class SingleRank(TPGroup):
    """tp = 1: the identity for every collective."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        pass


SINGLE_RANK = SingleRank()


class DistTPGroup(TPGroup):
    """tp > 1 over torch.distributed's default process group (one TP group per process)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.size, self.device = rank, size, device
        self._ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._dist.all_reduce(tensor, op=self._ops[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._dist.broadcast(tensor, src=src)
        return tensor

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def init_tp_group(rank: int, size: int, init_method: str, device: str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the node's TP group. ``init_method`` is torch.distributed's rendezvous address, e.g.
    ``tcp://127.0.0.1:29500`` (rank 0 listens there). size 1 returns ``SINGLE_RANK``."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is not in [0, tp size {size})")
    if size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    comm_device = torch.device(rank_device(device, rank, size) if backend == "nccl" else "cpu")
    if backend == "nccl":  # NCCL binds a communicator to the current device: make it this rank's
        torch.cuda.set_device(comm_device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    log.info("joined TP group: rank %d of %d (%s via %s)", rank, size, backend, init_method)
    return DistTPGroup(rank, size, comm_device)


def rank_device(device: str, rank: int, size: int) -> str:
    """Each rank of a CUDA node drives its own GPU: "cuda" means "cuda:<rank>" when tp > 1."""
    return f"cuda:{rank}" if size > 1 and device == "cuda" else device


def rank_cpu_config(cpu: CpuConfig, rank: int, size: int) -> CpuConfig:
    """This rank's share of the node's CPU budget: the bound cores (or, unbound, the cores the
    process may use) dealt out in contiguous blocks, threads divided evenly, at least one each.
    Without this every rank would size torch's pool to all the node's cores and the ranks would
    oversubscribe them ``size`` times over (see common/cpu_budget.py)."""
    if size == 1:
        return cpu
    cores = list(cpu.bind) or allowed_cpus()
    threads = max(1, (cpu.threads or len(cores)) // size)
    if not cpu.bind:
        return CpuConfig(threads=threads)
    per = max(1, len(cores) // size)
    mine = tuple(cores[(rank * per) % len(cores):][:per]) or (cores[rank % len(cores)],)
    return CpuConfig(threads=min(threads, len(mine)), bind=mine)
