"""The node launcher, both roles: flags both take, the node config they build (``role_config``),
the spawned scheduler child, ``run_node`` (the launcher's life from config to exit) and
``node_main`` (a role's ``main``: flags -> config -> ``run_node``). Each role's ``__main__`` adds
only its own flags, its role part and, for the prefill, the bootstrap registry it embeds.

::

    launcher (API process)                        scheduler process (spawned)
    node_main(role, argv, parser, ...):  parse, log, config (exit 2 on a bad flag)
    run_node(cfg, api_cfg, part):
      sidecar.start()   (prefill: bootstrap registry)
      SchedulerChild.start() ──spawn──> common.node.process.run_scheduler(part, cfg, endpoints)
      SchedulerChild.wait_ready()  <── ("ready", info) | ("error", reason) over a pipe
      run_api_server(...)          <== ZMQ ipc ==>  NodeIO in the scheduler process
      SchedulerChild.stop()        ──SIGTERM (SIGKILL after a grace period)──>
      sidecar.stop()

Exit status: 2 for a bad flag (``ConfigError``, before anything starts), 1 when the node cannot
start (port taken, model that does not load: the reason is logged) or, for a role that exits
with its scheduler, when the scheduler died; 0 after a normal shutdown. Never a node that serves
503s forever because its scheduler never came up.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from common import envs
from common.auth import SecretError, check_exposure, resolve_secret
from common.config import (
    AttentionConfig,
    CacheConfig,
    ConfigError,
    GrammarConfig,
    KVEventsConfig,
    ModelConfig,
    NodeConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    TransferConfig,
    node_device,
    resolve,
)
from common.cpu_budget import CpuBudgetError, CpuConfig, cpu_config
from common.http_limits import BYTES_PER_TOKEN, MIN_NODE_BODY_BYTES
from common.ipc.protocol import IpcEndpoints
from common.ports import free_port
from common.server.config import ApiConfig

if TYPE_CHECKING:  # the API process never imports the scheduler's side (torch, the model)
    from common.node.process import RolePart

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # loading a big checkpoint onto a GPU can take minutes
STOP_GRACE_S = 10.0


class StartupError(RuntimeError):
    """The scheduler process could not start; the message says why."""


# -- flags and config ---------------------------------------------------------------------------------


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
    p.add_argument("--cpu-linear", default=ModelConfig.cpu_linear, choices=("auto", "packed", "native", "bf16", "plain"),
                   help="CPU projections: packed for our C++ kernel (native; auto picks it for float32 on CPU where "
                        "it builds), for oneDNN (packed), or MKL's plain ones; "
                        "bf16: packed in bfloat16, the rest float32 (faster on CPUs with AVX512-BF16 or AMX, "
                        f"not HF-exact) {d}")
    p.add_argument("--torch-decode-mirror-mib", type=int, default=AttentionConfig.torch_decode_mirror_mib,
                   help=f"torch attention: memory for contiguous copies of the decoding requests' K/V, which "
                        f"spare each decode step a gather of the whole context (0: off) {d}")
    p.add_argument("--cuda-graph-max-bs", type=int, default=AttentionConfig.cuda_graph_max_bs,
                   help=f"GPU: capture the decode forward as CUDA graphs for batch sizes up to this {d}")
    p.add_argument("--disable-cuda-graph", action="store_true", help="GPU: run every decode step eagerly")
    p.add_argument("--host", default="127.0.0.1", help=f"listen address; also what peers reach us on {d}")
    p.add_argument("--port", type=int, default=port, help=f"HTTP port {d}")
    p.add_argument("--max-payload-size", type=int, metavar="BYTES",
                   help=f"largest request body; a larger one is a 413 before it is read (default: "
                        f"{BYTES_PER_TOKEN} bytes per context token, at least {MIN_NODE_BODY_BYTES})")
    p.add_argument("--header-timeout-s", type=float, default=ServerConfig.header_timeout_s,
                   help=f"close a connection whose request head has not arrived this long after it opened {d}")
    p.add_argument("--body-timeout-s", type=float, default=ServerConfig.body_timeout_s,
                   help=f"a request body not in this long after its head is a 408 {d}")
    p.add_argument("--max-n", type=int, default=ServerConfig.max_n, help=f"most samples (n) per prompt {d}")
    p.add_argument("--ssl-certfile", metavar="PATH", help="serve HTTPS with this certificate (chain) in PEM")
    p.add_argument("--ssl-keyfile", metavar="PATH", help="its private key in PEM (default: inside --ssl-certfile)")
    p.add_argument("--ssl-ca-certs", metavar="PATH",
                   help="require a client certificate signed by these CAs (mutual TLS: the router's "
                        "--worker-ssl-certfile); needs --ssl-certfile")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=TransferConfig.bootstrap_port,
                   help=f"prefill: embedded bootstrap server port; decode: port assumed when a request names none {d}")
    p.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=("mooncake", "fake"), help=d)
    p.add_argument("--page-size", type=int, default=CacheConfig.page_size, help=f"tokens per KV page {d}")
    p.add_argument("--transfer-staging-pages", type=int, metavar="N",
                   help="KV pages of staging per rank for head slices between unequal TP sizes: per transfer worker "
                        "on a prefill (default 64), the landing area on a decode (default a quarter of its KV pool); "
                        "0: serve only peers of the same TP size")
    p.add_argument("--mem-fraction-static", type=float, default=CacheConfig.mem_fraction_static,
                   help=f"GPU memory fraction for the KV pool {d}")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from free memory / CPU default)")
    p.add_argument("--max-running-requests", type=int, default=CacheConfig.max_running_requests, help=d)
    p.add_argument("--tp-size", type=int, default=ParallelConfig.tp_size,
                   help=f"tensor-parallel ranks: one scheduler process per rank, each holding 1/N of the "
                        f"weights and its own KV heads, each with 1/N of --cpu-threads (CPU: gloo; CUDA: one GPU "
                        f"per rank, NCCL) {d}")
    p.add_argument("--cpu-threads", type=int, help="torch threads of the scheduler process (default: PDC_CPU_THREADS, "
                   "else the cores it may use, on a GPU node 1; pdcluster up divides the cores among its CPU nodes)")
    p.add_argument("--cpu-bind", help="pin the scheduler process to these cores, e.g. 0-3,8 (default: PDC_CPU_BIND; none)")
    p.add_argument("--cpu-share", metavar="GROUP",
                   help="core-share group of the nodes on this host: a decode step borrows the cores an idle "
                        "neighbour of the group lends (default: PDC_CPU_SHARE; none: off; pdcluster up sets one)")
    p.add_argument("--cluster-secret", help="shared secret the router and peers must present (default: "
                   "PDC_CLUSTER_SECRET; none: access control off). A flag shows in `ps`: prefer the variable or the file")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="read the cluster secret from this file (a mounted Secret)")
    p.add_argument("--accept-bearer-secret", action="store_true", default=None,
                   help="also accept the cluster secret itself as a bearer token, as sglang-router sends it "
                        "(default: PDC_ACCEPT_BEARER_SECRET; off: only request tokens, the secret never crosses the wire)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="start without a cluster secret although --host is not a loopback address "
                        "(default: PDC_INSECURE; off: such a node refuses to start)")
    p.add_argument("--grammar-backend", default=GrammarConfig.backend, choices=("llguidance", "none"),
                   help=f"constrained decoding (json_schema, regex, ebnf, response_format); none: such requests get a 400 {d}")
    p.add_argument("--grammar-cache-size", type=int, default=GrammarConfig.cache_size,
                   help=f"compiled grammars kept per node (least recently used evicted) {d}")
    p.add_argument("--grammar-threads", type=int, default=GrammarConfig.threads,
                   help=f"threads compiling grammars and computing the batch's token masks {d}")
    p.add_argument("--grammar-compile-timeout-s", type=float, default=GrammarConfig.compile_timeout_s,
                   help=f"a request whose grammar has not compiled this long after it arrived fails (400) {d}")


def add_kv_events_flags(p: argparse.ArgumentParser) -> None:
    """The prefix cache's KV events (common/node/kv_events.py); both roles, published only while
    the node's prefix cache is on."""
    d = "(default: %(default)s)"
    p.add_argument("--kv-events-port", type=int, default=KVEventsConfig.port,
                   help=f"port of the prefix cache's KV-event PUB socket (0: a free one; /server_info says which) {d}")
    p.add_argument("--disable-kv-events", action="store_true", help="publish no KV events")


def kv_events_config(ns: argparse.Namespace, *, prefix_cache: bool) -> KVEventsConfig:
    return KVEventsConfig(enabled=prefix_cache and not ns.disable_kv_events, port=ns.kv_events_port)


def grammar_config(ns: argparse.Namespace) -> GrammarConfig:
    return GrammarConfig(backend=ns.grammar_backend, cache_size=ns.grammar_cache_size, threads=ns.grammar_threads,
                         compile_timeout_s=ns.grammar_compile_timeout_s)


def model_config(ns: argparse.Namespace) -> ModelConfig:
    return ModelConfig(model_path=ns.model_path, tokenizer_path=ns.tokenizer_path, served_model_name=ns.served_model_name,
                       dtype=ns.dtype, device=ns.device, context_length=ns.context_length, cpu_linear=ns.cpu_linear)


def cache_config(ns: argparse.Namespace, *, enable_prefix_cache: bool) -> CacheConfig:
    return CacheConfig(page_size=ns.page_size, mem_fraction_static=ns.mem_fraction_static,
                       max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
                       enable_prefix_cache=enable_prefix_cache)


def transfer_config(ns: argparse.Namespace) -> TransferConfig:
    try:
        secret = resolve_secret(ns.cluster_secret, ns.cluster_secret_file, envs.CLUSTER_SECRET, "--cluster-secret")
        check_exposure(ns.host, secret, envs.INSECURE.get() if ns.insecure is None else ns.insecure, "node")
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc
    accept_bearer = envs.ACCEPT_BEARER_SECRET.get() if ns.accept_bearer_secret is None else ns.accept_bearer_secret
    return TransferConfig(backend=ns.disaggregation_transfer_backend, bootstrap_port=ns.disaggregation_bootstrap_port,
                          cluster_secret=secret, accept_bearer_secret=accept_bearer,
                          staging_pages=ns.transfer_staging_pages)


def server_config(ns: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=ns.host, port=ns.port, max_payload_size=ns.max_payload_size,
                        header_timeout_s=ns.header_timeout_s, body_timeout_s=ns.body_timeout_s, max_n=ns.max_n,
                        ssl_certfile=ns.ssl_certfile, ssl_keyfile=ns.ssl_keyfile, ssl_ca_certs=ns.ssl_ca_certs)


def attention_config(ns: argparse.Namespace) -> AttentionConfig:
    return AttentionConfig(backend=ns.attention_backend, torch_decode_mirror_mib=ns.torch_decode_mirror_mib,
                           cuda_graph_max_bs=ns.cuda_graph_max_bs, disable_cuda_graph=ns.disable_cuda_graph)


def parallel_config(ns: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp_size=ns.tp_size)


def cpu_slice(ns: argparse.Namespace) -> CpuConfig:
    """The scheduler's CPU budget from --cpu-threads / --cpu-bind (or their env vars), resolved."""
    try:
        return cpu_config(ns.cpu_threads, ns.cpu_bind, ns.cpu_share,
                          device=node_device(ns.device))
    except CpuBudgetError as exc:
        raise ConfigError(str(exc)) from exc


def role_config(role: str, ns: argparse.Namespace, *, sched: SchedulerConfig, prefix_cache: bool) -> NodeConfig:
    """The node config from the flags both roles take; the role gives its scheduler slice (built
    from its own flags) and whether its prefix cache is on (its KV events follow it)."""
    return NodeConfig(
        role=role,
        model=model_config(ns),
        cache=cache_config(ns, enable_prefix_cache=prefix_cache),
        sched=sched,
        attention=attention_config(ns),
        transfer=transfer_config(ns),
        server=server_config(ns),
        cpu=cpu_slice(ns),
        parallel=parallel_config(ns),
        kv_events=kv_events_config(ns, prefix_cache=prefix_cache),
        grammar=grammar_config(ns),
    )


# -- the scheduler child, seen from the launcher -------------------------------------------------------


class SchedulerChild:
    """The spawned scheduler: one process per TP rank (one at tp = 1). Start them, wait for every
    rank's start-up report, stop them, clean up. ``proc`` is rank 0's process."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str, endpoints: IpcEndpoints,
                 tp_size: int = 1) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA, ZMQ or Mooncake state
        # The ranks meet at rank 0's rendezvous port (torch.distributed); unused at tp = 1.
        init_method = f"tcp://127.0.0.1:{free_port()}" if tp_size > 1 else ""
        self.endpoints = endpoints
        self._recvs: list[Connection] = []
        self._sends: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(tp_size):
            recv, send = ctx.Pipe(duplex=False)
            self._recvs.append(recv)
            self._sends.append(send)
            self.procs.append(ctx.Process(target=target, args=(*args, rank, init_method, send),
                                          name=name if tp_size == 1 else f"{name}-tp{rank}"))

    @property
    def proc(self) -> mp.process.BaseProcess:
        return self.procs[0]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for send in self._sends:
            send.close()  # each child holds the only writer of its pipe: EOF on our end means it died
        self._sends = []

    def alive(self) -> bool:
        # is_alive() reaps a dead child; a pid probe (os.kill(pid, 0)) would see a zombie as alive.
        return all(p.pid is not None and p.is_alive() for p in self.procs)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """Rank 0's ("ready", info) payload, with every rank's pid under ``rank_pids``, once all
        ranks reported; StartupError naming why one failed or timed out."""
        deadline = time.monotonic() + timeout_s
        infos: dict[int, dict] = {}
        while len(infos) < len(self.procs):
            if time.monotonic() > deadline:
                raise StartupError(f"the scheduler did not become ready within {timeout_s:g} s")
            for rank, (recv, proc) in enumerate(zip(self._recvs, self.procs)):
                if rank in infos:
                    continue
                who = "the scheduler" if len(self.procs) == 1 else f"scheduler rank {rank}"
                if recv.poll(0.2 / len(self.procs)):
                    try:
                        kind, payload = recv.recv()
                    except EOFError as exc:
                        raise StartupError(f"{who} exited during start-up (status {proc.exitcode})") from exc
                    if kind != "ready":
                        raise StartupError(f"{who} failed to start: {payload}")
                    infos[rank] = payload
                elif not proc.is_alive():
                    raise StartupError(f"{who} process exited during start-up (status {proc.exitcode})")
        return {**infos[0], "rank_pids": [infos[r]["pid"] for r in range(len(self.procs))]}

    def wait_any_exit(self) -> None:
        """Block until any rank's process has exited."""
        mp.connection.wait([p.sentinel for p in self.procs])

    def stop(self) -> None:
        """SIGTERM rank 0 (it tells the other ranks to stop), then the others; SIGKILL whoever
        is left after a grace period; unlink the ipc socket files. Idempotent."""
        started = [p for p in self.procs if p.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in started:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("scheduler %d ignored SIGTERM for %g s; killing it", proc.pid, STOP_GRACE_S)
                proc.kill()
                proc.join(5.0)
        for recv in self._recvs:
            recv.close()
        for path in self.endpoints.socket_files():
            with contextlib.suppress(OSError):
                os.unlink(path)


# -- the launcher's life -------------------------------------------------------------------------


class Sidecar(Protocol):
    """Something the launcher runs beside the scheduler (the prefill's bootstrap registry)."""

    def start(self) -> None:
        """Raises ``StartupError`` (the node exits 1 with its message) when it cannot start."""
        ...

    def stop(self) -> None: ...


def node_config(role: str, ns: argparse.Namespace, from_args: Callable[[argparse.Namespace], NodeConfig]
                ) -> tuple[NodeConfig, ApiConfig] | None:
    """The resolved node config and the API's slice of it; None (after saying why on stderr)
    for a bad flag, which the launcher answers with exit status 2."""
    try:
        cfg = resolve(from_args(ns))
        api_cfg = ApiConfig.from_node_config(cfg)
        api_cfg.validate()
    except ConfigError as exc:
        print(f"pdcluster {role}: {exc}", file=sys.stderr)
        return None
    return cfg, api_cfg


def run_scheduler_rank(*args: Any) -> None:
    """The spawned rank's entry point: ``common.node.process.run_scheduler``, imported there, so
    the API process that spawns it imports neither torch nor the model code."""
    from common.node.process import run_scheduler

    run_scheduler(*args)


def run_node(cfg: NodeConfig, api_cfg: ApiConfig, part: RolePart, *,
             sidecar: Callable[[SchedulerChild], Sidecar] | None = None, exit_with_scheduler: bool = False) -> int:
    """Run one node until shutdown; the exit status (module docstring).

    ``sidecar(child)`` runs beside the scheduler, started first and stopped last. With
    ``exit_with_scheduler`` (the decode) the node shuts down when its scheduler dies, so a
    supervisor sees one failed node instead of a zombie half; without it (the prefill) the API
    stays up and answers 503, and ``/health`` says so.
    """
    from common.server import run_api_server

    role = part.role
    endpoints = IpcEndpoints.fresh()
    child = SchedulerChild(run_scheduler_rank, (part, cfg, endpoints), f"pdc-{role}-scheduler", endpoints,
                           cfg.parallel.tp_size)
    side = sidecar(child) if sidecar is not None else None
    stopping, died = threading.Event(), threading.Event()
    # Until uvicorn installs its own handlers, SIGTERM must still run the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        if side is not None:
            side.start()
        child.start()
        info = child.wait_ready()
        log.info("%s scheduler %s ready (CPU %s); serving HTTP on %s:%d", role,
                 ", ".join(map(str, info["rank_pids"])), info["cpu"], cfg.server.host, cfg.server.port)
        if exit_with_scheduler:
            threading.Thread(target=_watch_scheduler, args=(child, stopping, died, role), daemon=True).start()
        api_cfg = replace(api_cfg, server_info_extra={**api_cfg.server_info_extra,
                                                      "max_total_tokens": info["max_total_tokens"],
                                                      "scheduler_pid": info["pid"], "cpu": info["cpu"],
                                                      "tp_size": cfg.parallel.tp_size,
                                                      "scheduler_rank_pids": info["rank_pids"],
                                                      # start-up's objects, out of the collector's walk
                                                      "gc_frozen_objects": info["gc_frozen_objects"],
                                                      # where its KV events are published (docs/PROTOCOL.md §7)
                                                      **({"kv_events": info["kv_events"]} if "kv_events" in info else {}),
                                                      # its core board, when it shares cores (common/cpu_share.py)
                                                      **({"cpu_share": info["cpu_share"]} if "cpu_share" in info else {})})
        run_api_server(api_cfg, endpoints, scheduler_alive=child.alive)
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    except SystemExit:  # SIGTERM (re-raised by uvicorn after its graceful shutdown)
        if not died.is_set():
            raise
    finally:
        stopping.set()
        child.stop()
        if side is not None:
            side.stop()
    return 1 if died.is_set() else 0


def node_main(role: str, argv: list[str] | None, parser: argparse.ArgumentParser,
              from_args: Callable[[argparse.Namespace], NodeConfig],
              part: Callable[[NodeConfig, argparse.Namespace], RolePart], *, log_tag: str,
              sidecar: Callable[[NodeConfig, argparse.Namespace, SchedulerChild], Sidecar] | None = None,
              exit_with_scheduler: bool = False) -> int:
    """A role's ``main``: parse ``argv``, set up logging (lines tagged ``log_tag``), build and
    check the config (exit status 2 for a bad flag), then ``run_node`` with the role's part (and
    its sidecar, built with the child it runs beside). The exit status (module docstring)."""
    ns = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format=f"%(asctime)s %(levelname)s {log_tag} %(name)s: %(message)s")
    built = node_config(role, ns, from_args)
    if built is None:
        return 2
    cfg, api_cfg = built
    side = None if sidecar is None else functools.partial(sidecar, cfg, ns)
    return run_node(cfg, api_cfg, part(cfg, ns), sidecar=side, exit_with_scheduler=exit_with_scheduler)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _watch_scheduler(child: SchedulerChild, stopping: threading.Event, died: threading.Event, role: str) -> None:
    child.wait_any_exit()  # any rank: a TP node without one of its ranks cannot serve
    if not stopping.is_set():
        died.set()
        log.error("a %s scheduler process exited (status %s); shutting the node down", role,
                  [p.exitcode for p in child.procs])
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: graceful shutdown of the API
