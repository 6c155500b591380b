"""What the prefill and decode launchers share: the common flags, the node config they build,
the scheduler child process (spawn, wait for "ready", stop) and the scheduler-process entry
skeleton. Each role adds only its own flags and its own scheduler process class.

::

    launcher (API process)                        scheduler process (spawned)
    SchedulerChild.start() ──spawn──> run_scheduler_process(build) -> build() -> proc.serve(stop)
    SchedulerChild.wait_ready()  <── ("ready", info) | ("error", reason) over a pipe
    run_api_server(...)          <== ZMQ ipc ==>  NodeIO in proc
    SchedulerChild.stop()        ──SIGTERM (SIGKILL after a grace period)──>
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from common import envs
from common.auth import SecretError, resolve_secret
from common.config import AttentionConfig, CacheConfig, ConfigError, ModelConfig, ServerConfig, TransferConfig
from common.cpu_budget import CpuBudgetError, CpuConfig, apply_scheduler_budget, cpu_config
from common.ipc.protocol import IpcEndpoints

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # loading a big checkpoint onto a GPU can take minutes
STOP_GRACE_S = 10.0


class StartupError(RuntimeError):
    """The scheduler process could not start; the message says why."""


# -- flags and config ---------------------------------------------------------------------------


def add_node_flags(p: argparse.ArgumentParser, *, port: int) -> None:
    """Flags both roles take (names mirror SGLang's)."""
    d = "(default: %(default)s)"
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model path)")
    p.add_argument("--served-model-name", help="model name reported by the API (default: the model path)")
    p.add_argument("--context-length", type=int, help="max prompt + output tokens (default: from config.json)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"), help=d)
    p.add_argument("--device", default="auto", help=f"auto, cpu, cuda[:N] {d}")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"), help=d)
    p.add_argument("--host", default="127.0.0.1", help=f"listen address; also what peers reach us on {d}")
    p.add_argument("--port", type=int, default=port, help=f"HTTP port {d}")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=TransferConfig.bootstrap_port,
                   help=f"prefill: embedded bootstrap server port; decode: port assumed when a request names none {d}")
    p.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=("mooncake", "fake"), help=d)
    p.add_argument("--page-size", type=int, default=CacheConfig.page_size, help=f"tokens per KV page {d}")
    p.add_argument("--mem-fraction-static", type=float, default=CacheConfig.mem_fraction_static,
                   help=f"GPU memory fraction for the KV pool {d}")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from free memory / CPU default)")
    p.add_argument("--max-running-requests", type=int, default=CacheConfig.max_running_requests, help=d)
    p.add_argument("--cpu-threads", type=int, help="torch threads of the scheduler process (default: PDC_CPU_THREADS, "
                   "else the cores it may use; pdcluster up divides the cores among its nodes)")
    p.add_argument("--cpu-bind", help="pin the scheduler process to these cores, e.g. 0-3,8 (default: PDC_CPU_BIND; none)")
    p.add_argument("--cluster-secret", help="shared secret the router and peers must present (default: "
                   "PDC_CLUSTER_SECRET; none: access control off). A flag shows in `ps`: prefer the variable or the file")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="read the cluster secret from this file (a mounted Secret)")


def model_config(ns: argparse.Namespace) -> ModelConfig:
    return ModelConfig(model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, served_model_name=ns.served_model_name,
                       dtype=ns.dtype, device=ns.device, context_length=ns.context_length)


def cache_config(ns: argparse.Namespace, *, enable_prefix_cache: bool) -> CacheConfig:
    return CacheConfig(page_size=ns.page_size, mem_fraction_static=ns.mem_fraction_static,
                       max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
                       enable_prefix_cache=enable_prefix_cache)


def transfer_config(ns: argparse.Namespace) -> TransferConfig:
    try:
        secret = resolve_secret(ns.cluster_secret, ns.cluster_secret_file, envs.CLUSTER_SECRET, "--cluster-secret")
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc
    return TransferConfig(backend=ns.disaggregation_transfer_backend, bootstrap_port=ns.disaggregation_bootstrap_port,
                          cluster_secret=secret)


def server_config(ns: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=ns.host, port=ns.port)


def attention_config(ns: argparse.Namespace) -> AttentionConfig:
    return AttentionConfig(backend=ns.attention_backend)


def cpu_slice(ns: argparse.Namespace) -> CpuConfig:
    """The scheduler's CPU budget from --cpu-threads / --cpu-bind (or their env vars), resolved."""
    try:
        return cpu_config(ns.cpu_threads, ns.cpu_bind)
    except CpuBudgetError as exc:
        raise ConfigError(str(exc)) from exc


def advertise_host(host: str) -> str:
    """The address peers should use to reach us: ``host`` unless it is a wildcard."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it picks the outgoing interface
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


# -- the scheduler child, seen from the launcher -------------------------------------------------------


class SchedulerChild:
    """The spawned scheduler process: start, wait for its start-up report, stop, clean up."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str, endpoints: IpcEndpoints) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA, ZMQ or Mooncake state
        self._recv, send = ctx.Pipe(duplex=False)
        self._send: Connection | None = send
        self.endpoints = endpoints
        self.proc = ctx.Process(target=target, args=(*args, send), name=name)

    def start(self) -> None:
        self.proc.start()
        assert self._send is not None
        self._send.close()  # the child holds the only writer: EOF on our end means it died
        self._send = None

    def alive(self) -> bool:
        # is_alive() reaps a dead child; a pid probe (os.kill(pid, 0)) would see a zombie as alive.
        return self.proc.pid is not None and self.proc.is_alive()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """The scheduler's ("ready", info) payload; StartupError naming why it failed or timed out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._recv.poll(0.2):
                try:
                    kind, payload = self._recv.recv()
                except EOFError as exc:
                    raise StartupError(f"the scheduler process exited during start-up (status {self.proc.exitcode})") from exc
                if kind == "ready":
                    return payload
                raise StartupError(f"the scheduler failed to start: {payload}")
            if not self.proc.is_alive():
                raise StartupError(f"the scheduler process exited during start-up (status {self.proc.exitcode})")
        raise StartupError(f"the scheduler did not become ready within {timeout_s:g} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; unlink the ipc socket files. Idempotent."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(STOP_GRACE_S)
            if self.proc.is_alive():
                log.warning("scheduler %d ignored SIGTERM for %g s; killing it", self.proc.pid, STOP_GRACE_S)
                self.proc.kill()
                self.proc.join(5.0)
        self._recv.close()
        for path in self.endpoints.socket_files():
            with contextlib.suppress(OSError):
                os.unlink(path)


# -- the scheduler process's entry skeleton ----------------------------------------------------------------


class SchedulerProcess(Protocol):
    def ready_info(self) -> dict: ...

    def serve(self, stop: threading.Event) -> None: ...

    def close(self) -> None: ...


def run_scheduler_process(tag: str, build: Callable[[], SchedulerProcess], ready: Connection | None,
                          cpu: CpuConfig | None = None) -> None:
    """Body of a role's scheduler-process entry point: size the thread pools, build, report
    ready/error, serve until stop."""
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format=f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if cpu is not None:
            apply_scheduler_budget(cpu)  # before the model loads: torch's pools are sized once
        proc = build()
    except Exception as exc:
        log.exception("%s failed to start", tag)
        if ready is not None:
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    try:
        if ready is not None:
            cpu_info = cpu.as_dict() if cpu is not None else None
            ready.send(("ready", {"pid": os.getpid(), "cpu": cpu_info, **proc.ready_info()}))
            ready.close()
        proc.serve(stop)
    finally:
        proc.close()
