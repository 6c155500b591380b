"""Every environment variable pdcluster reads, typed, in one place.

Read nowhere else: code asks ``envs.NAME.get()``. Each variable is prefixed ``PDC_``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        kind = type(self.default)
        try:
            if kind is bool:
                return raw.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
            return kind(raw)  # type: ignore[call-arg]
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is not a valid {kind.__name__}") from exc


LOG_LEVEL = EnvVar("PDC_LOG_LEVEL", "INFO", "log level of every pdcluster process")
DEVICE = EnvVar("PDC_DEVICE", "auto", "torch device for the model runner: auto, cpu, cuda")
FUSED_KERNELS = EnvVar("PDC_FUSED_KERNELS", True, "GPU: FlashInfer's fused norm / SiLU-mul / RoPE kernels in the layers (0: plain torch ops)")
BOOTSTRAP_TIMEOUT_S = EnvVar("PDC_BOOTSTRAP_TIMEOUT_S", 30.0, "seconds a room may stay Bootstrapping")
WAITING_TIMEOUT_S = EnvVar("PDC_WAITING_TIMEOUT_S", 60.0, "seconds a decode room may wait for its KV")
HEARTBEAT_INTERVAL_S = EnvVar("PDC_HEARTBEAT_INTERVAL_S", 1.0, "decode -> prefill health probe interval")
HEARTBEAT_MAX_FAILURES = EnvVar("PDC_HEARTBEAT_MAX_FAILURES", 3, "missed probes before a prefill is dead")
TRANSFER_WORKERS = EnvVar("PDC_TRANSFER_WORKERS", 2, "transfer worker threads per prefill rank")
TRANSFER_MAX_BATCH_ENTRIES = EnvVar("PDC_TRANSFER_MAX_BATCH_ENTRIES", 2000, "descriptors per peer per engine call (mooncake TCP fails past ~2050)")
HUNG_PEER_QUARANTINE_S = EnvVar("PDC_HUNG_PEER_QUARANTINE_S", 10.0, "hold pages of a dead-declared but still-listening prefill this long")
MAX_FENCE_S = EnvVar("PDC_MAX_FENCE_S", 300.0, "longest a decode holds the pages of a room whose prefill stopped answering (0: until proven gone)")
IDLE_PEER_PURGE_S = EnvVar("PDC_IDLE_PEER_PURGE_S", 60.0, "prefill forgets a silent decode peer after this long")
MOONCAKE_TRANSFER_TIMEOUT_S = EnvVar("PDC_MOONCAKE_TRANSFER_TIMEOUT_S", 5.0, "seconds one mooncake write may block on a hung peer (floor 5)")
MOONCAKE_PROTOCOL = EnvVar("PDC_MOONCAKE_PROTOCOL", "auto", "mooncake protocol: auto, rdma, tcp")
CPU_THREADS = EnvVar("PDC_CPU_THREADS", 0, "torch threads of a node's scheduler process (0: the cores it may use, on a GPU node 1); --cpu-threads wins")
CPU_BIND = EnvVar("PDC_CPU_BIND", "", "cores to pin a node's scheduler process to, e.g. 0-3 (empty: no pinning); --cpu-bind wins")
CPU_SHARE = EnvVar("PDC_CPU_SHARE", "", "core-share group of co-located nodes: a decode step borrows the cores its idle neighbours lend (empty: off); --cpu-share wins")
NATIVE_KERNELS = EnvVar("PDC_NATIVE_KERNELS", True, "CPU: build and use our C++ kernels (decode attention over the mirror, projections) with the machine's compiler (0: torch ops and oneDNN only)")
NATIVE_DECODE_STEP = EnvVar("PDC_NATIVE_DECODE_STEP", True, "CPU: a Llama-family decode step runs as one call of our C++ kernel where every projection is ours (0: layer by layer, the same kernels inside)")
KERNEL_CACHE_DIR = EnvVar("PDC_KERNEL_CACHE_DIR", "", "where built C++ kernels are cached (empty: $XDG_CACHE_HOME or ~/.cache, then pdcluster/kernels)")
MALLOC_TUNING = EnvVar("PDC_MALLOC_TUNING", True, "scheduler processes keep freed activation memory mapped (glibc mallopt; 0: glibc's defaults)")
CPU_SHARE_DIR = EnvVar("PDC_CPU_SHARE_DIR", "", "directory of the core-share boards (empty: /dev/shm, else /tmp)")
MOONCAKE_DEVICE = EnvVar("PDC_MOONCAKE_DEVICE", "", "RDMA device names for mooncake (empty: auto)")
CLUSTER_SECRET = EnvVar("PDC_CLUSTER_SECRET", "", "shared secret of nodes, registry and router (empty: off); --cluster-secret[-file] wins")
FAULT_STOP_BEFORE_WRITE_ROOM = EnvVar(
    "PDC_FAULT_STOP_BEFORE_WRITE_ROOM", -1,
    "FAULT INJECTION, tests only (-1: off): a prefill transfer worker SIGSTOPs its own process right before its first engine write for this room")
FAULT_STOP_AFTER_WRITES = EnvVar(
    "PDC_FAULT_STOP_AFTER_WRITES", 0,
    "FAULT INJECTION, tests only: engine writes of PDC_FAULT_STOP_BEFORE_WRITE_ROOM a worker lets through before it stops (0: before the first)")
FAULT_DECODE_STEP_DELAY_S = EnvVar(
    "PDC_FAULT_DECODE_STEP_DELAY_S", 0.0,
    "FAULT INJECTION, tests only (0: off): a decode node sleeps this long after each decode step, so a test can act on a request mid-generation")
FAULT_STOP_RANK = EnvVar("PDC_FAULT_STOP_RANK", -1, "FAULT INJECTION, tests only: only this TP rank stops for PDC_FAULT_STOP_BEFORE_WRITE_ROOM (-1: every rank)")
ACCEPT_BEARER_SECRET = EnvVar("PDC_ACCEPT_BEARER_SECRET", False, "nodes also accept the cluster secret as a bearer token (for sglang-router); --accept-bearer-secret wins")
INSECURE = EnvVar("PDC_INSECURE", False, "let a node or registry listen on a non-loopback address without a cluster secret; --insecure wins")
TP_TIMEOUT_S = EnvVar("PDC_TP_TIMEOUT_S", 300.0, "longest a TP rank waits for the node's other ranks in one collective before it fails")
KV_INTEGRITY = EnvVar("PDC_KV_INTEGRITY", True, "digest KV pages (prefill) and check what arrives (decode); both roles must agree")
OPERATOR_KEY = EnvVar("PDC_OPERATOR_KEY", "", "the router's operator key, for adding/draining workers, /flush_cache, /abort_request; --operator-key[-file] wins")
API_KEY = EnvVar("PDC_API_KEY", "", "the router's client API key (empty: off); --api-key[-file] wins")


def all_vars() -> list[EnvVar]:
    return [v for v in globals().values() if isinstance(v, EnvVar)]
