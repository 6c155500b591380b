"""Typed configuration: one frozen dataclass per subsystem, composed into ``NodeConfig``.

Each component receives only its own slice (narrow constructors). ``"auto"`` values are
filled by ``resolve()`` once the device and the model are known; validation errors raise
``ConfigError`` with a message that names the flag.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Literal

from common import envs
from common.cpu_budget import CpuConfig
from common.http_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_N


class ConfigError(ValueError):
    """A bad configuration value, detected at start-up."""


# Top logprobs of the first token carried in an aux row (transfer/aux.py): part of the wire layout,
# so prefill and decode must use the same value (checked when the decode registers its KV args).
AUX_TOP_K = 20


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto -> float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto -> cuda if available else cpu
    context_length: int | None = None  # None -> model's max_position_embeddings
    # Projections on CPU: oneDNN-packed weights or MKL's plain ones (common/models/linear.py);
    # "auto" is resolved by the model runner (it needs torch): packed for float32 on CPU. "bf16":
    # packed in bfloat16, the rest float32 (not HF-exact; for CPUs with bfloat16 instructions).
    cpu_linear: str = "auto"

    def validate(self) -> None:
        if not os.path.isdir(self.model_path):
            raise ConfigError(f"--model-path {self.model_path!r} is not a directory")
        if not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise ConfigError(f"--model-path {self.model_path!r} has no config.json")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"--dtype {self.dtype!r}: expected auto, float32, float16 or bfloat16")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device {self.device!r}: expected auto, cpu or cuda[:N]")
        if self.cpu_linear not in ("auto", "packed", "native", "bf16", "plain"):
            raise ConfigError(f"--cpu-linear {self.cpu_linear!r}: expected auto, packed, native, bf16 or plain")

    def hf_config(self) -> dict:
        with open(os.path.join(self.model_path, "config.json")) as f:
            return json.load(f)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    mem_fraction_static: float = 0.8
    max_total_tokens: int | None = None  # None -> sized from free memory (GPU) or a CPU default
    max_running_requests: int = 64
    enable_prefix_cache: bool = True

    def validate(self) -> None:
        if not _is_pow2(self.page_size):
            raise ConfigError(f"--page-size must be a power of two, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ConfigError(f"--max-total-tokens {self.max_total_tokens} is smaller than two pages")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 2048  # <= 0 disables chunking
    max_prefill_tokens: int = 8192
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    new_token_ratio_init: float = 0.7
    new_token_ratio_min: float = 0.1
    new_token_ratio_decay_steps: int = 600
    # Decode: KV headroom kept per running request when admitting new rooms.
    reserved_decode_tokens: int = 128
    # Decode: request rows beyond max_running_requests, for rooms in transfer and waiting. Without
    # them a full running batch would stop all pre-allocation and the next requests' transfers.
    prealloc_rows: int | None = None  # None -> max_running_requests
    # Decode: a streamed request's output goes out every this many tokens (SGLang's and vLLM's
    # --stream-interval); its first token and its end always go at once.
    stream_interval: int = 1
    # Prefill: share of the KV pool that prompts computed before their decode said where to write
    # may hold (prefill_node/scheduler.py, "Computing ahead"); 0: wait for the decode first.
    compute_ahead_fraction: float = 0.25

    def validate(self) -> None:
        if not 0.0 <= self.compute_ahead_fraction <= 1.0:
            raise ConfigError(f"--compute-ahead-fraction must be in [0, 1], got {self.compute_ahead_fraction}")
        if self.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError(f"--schedule-policy {self.schedule_policy!r}: expected fcfs or lpm")
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0.0 <= self.new_token_ratio_min <= self.new_token_ratio_init <= 1.0:
            raise ConfigError(f"new-token ratio: need 0 <= min ({self.new_token_ratio_min}) <= init "
                              f"({self.new_token_ratio_init}) <= 1 (--schedule-conservativeness scales both)")
        if self.reserved_decode_tokens < 1:
            raise ConfigError(f"--num-reserved-decode-tokens must be >= 1, got {self.reserved_decode_tokens}")
        if self.prealloc_rows is not None and self.prealloc_rows < 0:
            raise ConfigError(f"prealloc_rows must be >= 0, got {self.prealloc_rows}")


@dataclass(frozen=True)
class AttentionConfig:
    backend: str = "auto"  # auto -> flashinfer on CUDA when importable, else torch
    # Torch backend: memory for contiguous copies of the decoding requests' K/V (decode_mirror.py),
    # which spare every decode step a gather of the whole context; 0 turns it off.
    torch_decode_mirror_mib: int = 1024
    # CUDA graphs of the decode forward (common/engine/cuda_graph.py): batch sizes up to this are
    # captured (never past --max-running-requests); larger batches run eagerly. Needs a backend
    # that supports capture (flashinfer); ignored on CPU.
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False

    def validate(self) -> None:
        if self.backend not in ("auto", "torch", "flashinfer"):
            raise ConfigError(f"--attention-backend {self.backend!r}: expected auto, torch or flashinfer")
        if self.torch_decode_mirror_mib < 0:
            raise ConfigError(f"--torch-decode-mirror-mib must be >= 0, got {self.torch_decode_mirror_mib}")
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["mooncake", "fake"] = "mooncake"
    bootstrap_port: int = 8998
    bootstrap_timeout_s: float = field(default_factory=envs.BOOTSTRAP_TIMEOUT_S.get)
    waiting_timeout_s: float = field(default_factory=envs.WAITING_TIMEOUT_S.get)
    heartbeat_interval_s: float = field(default_factory=envs.HEARTBEAT_INTERVAL_S.get)
    heartbeat_max_failures: int = field(default_factory=envs.HEARTBEAT_MAX_FAILURES.get)
    num_workers: int = field(default_factory=envs.TRANSFER_WORKERS.get)
    max_batch_entries: int = field(default_factory=envs.TRANSFER_MAX_BATCH_ENTRIES.get)
    hung_peer_quarantine_s: float = field(default_factory=envs.HUNG_PEER_QUARANTINE_S.get)
    max_fence_s: float = field(default_factory=envs.MAX_FENCE_S.get)
    idle_peer_purge_s: float = field(default_factory=envs.IDLE_PEER_PURGE_S.get)
    write_timeout_s: float = field(default_factory=envs.MOONCAKE_TRANSFER_TIMEOUT_S.get)
    # Top logprobs each aux row carries with the first token; fixes the aux row layout both roles share.
    aux_top_k: int = AUX_TOP_K
    # The cluster's shared secret (common/auth.py), or None: access control off. It guards this
    # node's HTTP API, its bootstrap registry and the control plane. repr=False: never logged.
    cluster_secret: str | None = field(default=None, repr=False)
    # Also take the bare secret as a bearer token on HTTP: what sglang-router 0.3.2 sends to
    # workers (its --api-key). Off by default: then the secret itself never crosses the wire.
    accept_bearer_secret: bool = field(default_factory=envs.ACCEPT_BEARER_SECRET.get)
    # Staging for head slices between unequal TP sizes (transfer/staging.py), in this rank's KV
    # pages: per transfer worker on a prefill, the landing area on a decode. None: the role's
    # default (prefill 64 per worker; decode a quarter of its KV pool). 0: none, and then only
    # peers of the same TP size are served (others are refused at lookup, naming the field).
    staging_pages: int | None = None

    def validate(self) -> None:
        if self.staging_pages is not None and self.staging_pages < 0:
            raise ConfigError(f"--transfer-staging-pages must be >= 0, got {self.staging_pages}")
        if self.backend not in ("mooncake", "fake"):
            raise ConfigError(f"--disaggregation-transfer-backend {self.backend!r}: expected mooncake or fake")
        if not 0 < self.bootstrap_port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port {self.bootstrap_port} out of range")
        if self.aux_top_k < 0:
            raise ConfigError(f"aux_top_k must be >= 0, got {self.aux_top_k}")


@dataclass(frozen=True)
class KVEventsConfig:
    """The prefix cache's KV events (common/kvcache/kv_event_log.py): a ZMQ PUB socket on the
    advertised host, announced in /server_info; off with the prefix cache."""

    enabled: bool = True
    port: int = 0  # 0: a free port, chosen at start

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--kv-events-port {self.port} out of range")


@dataclass(frozen=True)
class GrammarConfig:
    """Constrained decoding (common/grammar): which library, how many compiled grammars are kept,
    the threads that compile them and compute the batch's token masks, and how long a request
    waits for its grammar before it fails (400)."""

    backend: Literal["llguidance", "none"] = "llguidance"
    cache_size: int = 256  # compiled grammars kept (least recently used evicted)
    threads: int = 2
    compile_timeout_s: float = 10.0

    def validate(self) -> None:
        if self.backend not in ("llguidance", "none"):
            raise ConfigError(f"--grammar-backend {self.backend!r}: expected llguidance or none")
        if self.cache_size < 1:
            raise ConfigError(f"--grammar-cache-size must be >= 1, got {self.cache_size}")
        if self.threads < 1:
            raise ConfigError(f"--grammar-threads must be >= 1, got {self.threads}")
        if not self.compile_timeout_s > 0:
            raise ConfigError(f"--grammar-compile-timeout-s must be > 0, got {self.compile_timeout_s}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    # The API's client input limits (defaults and reasons: common/http_limits.py).
    max_payload_size: int | None = None  # None: from the context length
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = MAX_N
    # HTTPS (sglang's flag names); with a CA, clients must show a certificate it signed (mutual TLS).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None  # None: the key is inside the certfile
    ssl_ca_certs: str | None = None

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} out of range")
        if self.ssl_certfile is None and (self.ssl_keyfile is not None or self.ssl_ca_certs is not None):
            raise ConfigError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")
        for flag, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1  # scheduler ranks per node, each holding 1/tp of the model (common/parallel.py)

    def validate(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size {self.tp_size}: must be >= 1")


@dataclass(frozen=True)
class NodeConfig:
    role: Literal["prefill", "decode"]
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    sched: SchedulerConfig = SchedulerConfig()
    attention: AttentionConfig = AttentionConfig()
    transfer: TransferConfig = TransferConfig()
    server: ServerConfig = ServerConfig()
    cpu: CpuConfig = CpuConfig()
    parallel: ParallelConfig = ParallelConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    grammar: GrammarConfig = GrammarConfig()

    def validate(self) -> None:
        for part in (self.model, self.cache, self.sched, self.attention, self.transfer, self.server, self.parallel,
                     self.kv_events, self.grammar):
            part.validate()
        try:
            self.cpu.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def resolve_device(device: str) -> str:
    if device == "auto":
        if _cpu_only_torch():  # answered without importing torch: the API process never needs it
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def node_device(flag: str, env_device: str | None = None) -> str:
    """The device a node runs on: its --device, or PDC_DEVICE (``env_device`` when given: a child's
    environment) where the flag is "auto", resolved."""
    return resolve_device((envs.DEVICE.get() if env_device is None else env_device) if flag == "auto" else flag)


def _cpu_only_torch() -> bool:
    """True for PyTorch's CPU-only wheels (local version ``+cpu``, what requirements/cpu.lock
    installs), where ``torch.cuda.is_available()`` is always False."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


def resolve(cfg: NodeConfig) -> NodeConfig:
    """Validate and fill every "auto" value that does not need the model loaded."""
    cfg.validate()
    device = node_device(cfg.model.device)
    model = replace(cfg.model, device=device, dtype=resolve_dtype(cfg.model.dtype, device))
    attn = cfg.attention
    if attn.backend == "auto":
        attn = replace(attn, backend="flashinfer" if device.startswith("cuda") else "torch")
    return replace(cfg, model=model, attention=attn)
