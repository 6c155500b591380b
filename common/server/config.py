"""The API process's slice of configuration."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

from common.auth import is_loopback
from common.config import ConfigError, NodeConfig
from common.http_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_N, node_body_limit


@dataclass(frozen=True)
class ApiConfig:
    role: Literal["prefill", "decode"]
    model_path: str
    context_length: int  # prompt + generated tokens per sequence
    served_model_name: str = ""  # "" -> model_path
    tokenizer_path: str | None = None  # None -> model_path
    model_type: str = "unknown"
    architectures: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    # Filled into a request whose bootstrap_host is set but bootstrap_port is null (the router
    # sends null when it was started without a port for that prefill).
    bootstrap_port: int = 8998
    # Default max_new_tokens per API when the body names none (SGLang's defaults); chat uses
    # the rest of the context.
    generate_default_max_new_tokens: int = 128
    completion_default_max_tokens: int = 16
    query_timeout_s: float = 5.0  # /get_load, /metrics, /debug/memory, /flush_cache
    health_generate_timeout_s: float = 20.0
    max_batch_size: int = 10000  # sub-requests per HTTP request (batch items x n)
    # Client input limits (common/server/limits.py): bodies (None: from the context length,
    # common.http_limits.node_body_limit), a request head's and a body's time, samples per prompt.
    max_payload_size: int | None = None
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = MAX_N
    # Extra keys merged into /server_info (page size, max_total_tokens, ... from the launcher).
    server_info_extra: dict = field(default_factory=dict)
    # With a secret, every route but /health needs a request token made from it (repr=False).
    cluster_secret: str | None = field(default=None, repr=False)
    # Also take the bare secret as a bearer token (sglang-router 0.3.2 sends nothing else).
    accept_bearer_secret: bool = False
    # The scheduler's grammar backend: specs are checked against it at parse time ("none": 400).
    grammar_backend: str = "llguidance"
    # HTTPS; with ssl_ca_certs a client certificate signed by it is required (common/config.ServerConfig).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def body_limit(self) -> int:
        return self.max_payload_size if self.max_payload_size is not None else node_body_limit(self.context_length)

    def validate(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role {self.role!r}: expected prefill or decode")
        if self.context_length < 2:
            raise ConfigError(f"context length {self.context_length} must be >= 2")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} out of range")
        if self.max_payload_size is not None and self.max_payload_size < 1:
            raise ConfigError(f"--max-payload-size must be >= 1, got {self.max_payload_size}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ConfigError("--header-timeout-s and --body-timeout-s must be > 0")
        if self.max_n < 1:
            raise ConfigError(f"--max-n must be >= 1, got {self.max_n}")

    @classmethod
    def from_node_config(cls, cfg: NodeConfig, **extra: object) -> ApiConfig:
        """Build from the node's config; the model's config.json supplies what the flags left out."""
        hf = cfg.model.hf_config()
        ctx = cfg.model.context_length or hf.get("max_position_embeddings")
        if not isinstance(ctx, int):
            raise ConfigError(f"{os.path.join(cfg.model.model_path, 'config.json')} has no "
                              "max_position_embeddings; pass --context-length")
        return cls(
            role=cfg.role,
            model_path=cfg.model.model_path,
            tokenizer_path=cfg.model.tokenizer_path,
            served_model_name=cfg.model.served_model_name or "",
            context_length=ctx,
            model_type=str(hf.get("model_type", "unknown")),
            architectures=tuple(hf.get("architectures") or ()),
            host=cfg.server.host,
            port=cfg.server.port,
            max_payload_size=cfg.server.max_payload_size,
            header_timeout_s=cfg.server.header_timeout_s,
            body_timeout_s=cfg.server.body_timeout_s,
            max_n=cfg.server.max_n,
            ssl_certfile=cfg.server.ssl_certfile,
            ssl_keyfile=cfg.server.ssl_keyfile,
            ssl_ca_certs=cfg.server.ssl_ca_certs,
            bootstrap_port=cfg.transfer.bootstrap_port,
            cluster_secret=cfg.transfer.cluster_secret,
            accept_bearer_secret=cfg.transfer.accept_bearer_secret,
            grammar_backend=cfg.grammar.backend,
            server_info_extra={
                "page_size": cfg.cache.page_size,
                "max_total_tokens": cfg.cache.max_total_tokens,
                "max_running_requests": cfg.cache.max_running_requests,
                "chunked_prefill_size": cfg.sched.chunked_prefill_size,
                # the precision the projections run in: what a benchmark divides by (bench_efficiency)
                "dtype": cfg.model.dtype,
                "cpu_linear": cfg.model.cpu_linear,
                "disaggregation_transfer_backend": cfg.transfer.backend,
                "cluster_secret_required": cfg.transfer.cluster_secret is not None,
                # Said in /server_info too: a node open to the network (--insecure) is visible as such.
                "insecure": cfg.transfer.cluster_secret is None and not is_loopback(cfg.server.host),
            },
            **extra,  # type: ignore[arg-type]
        )

    @classmethod
    def for_model_dir(cls, role: Literal["prefill", "decode"], model_path: str, **kw: object) -> ApiConfig:
        """Convenience for tools and tests: read context length and names from config.json."""
        with open(os.path.join(model_path, "config.json")) as f:
            hf = json.load(f)
        kw.setdefault("context_length", int(hf.get("max_position_embeddings", 2048)))
        return cls(
            role=role,
            model_path=model_path,
            model_type=str(hf.get("model_type", "unknown")),
            architectures=tuple(hf.get("architectures") or ()),
            **kw,  # type: ignore[arg-type]
        )
