"""Launch a prefill node: bootstrap server + scheduler process + API process (this one).

::

    pdcluster prefill --model-path DIR [--host H --port P --disaggregation-bootstrap-port B
                      --disaggregation-transfer-backend mooncake|fake --page-size N ...]

    this process                                       child (spawned)
    ------------                                       ---------------
    1. BootstrapServer on B (thread)   <-- PUT /route --  PrefillKVManager registers its rank
    2. spawn scheduler, wait for "ready" <-- pipe -----   model loaded, pools built, rank registered
    3. uvicorn: FastAPI app  <== ZMQ ipc (common.protocol) ==>  scheduler loop
    4. on exit: SIGTERM the scheduler (SIGKILL after a grace period), stop the bootstrap server

Start-up fails fast with exit status 1 and the reason when the scheduler cannot start (bad model,
port taken, mooncake missing), instead of serving 503s forever. ``/health`` stays 503 until the
scheduler has answered, and turns 503 again if it dies (the API watches its pid).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from common import envs
from common.config import (
    AttentionConfig,
    CacheConfig,
    ConfigError,
    ModelConfig,
    NodeConfig,
    SchedulerConfig,
    ServerConfig,
    TransferConfig,
    resolve,
)
from common.protocol import IpcEndpoints
from common.server.config import ApiConfig
from prefill_node.process import PrefillOptions, run_scheduler

log = logging.getLogger("prefill_node")

STARTUP_TIMEOUT_S = 900.0  # model load on a big GPU checkpoint can take minutes
STOP_GRACE_S = 10.0


class StartupError(RuntimeError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster prefill", description="Run a prefill node (flags mirror SGLang's).")
    d = "(default: %(default)s)"
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model path)")
    p.add_argument("--served-model-name", help="model name reported by the API (default: the model path)")
    p.add_argument("--context-length", type=int, help="max prompt + output tokens (default: from config.json)")
    p.add_argument("--dtype", default="auto", help=f"auto, float32, float16, bfloat16 {d}")
    p.add_argument("--device", default="auto", help=f"auto, cpu, cuda[:N] {d}")
    p.add_argument("--attention-backend", default="auto", help=f"auto, torch, flashinfer {d}")
    p.add_argument("--host", default="127.0.0.1", help=f"HTTP and bootstrap listen address {d}")
    p.add_argument("--port", type=int, default=30000, help=f"HTTP port {d}")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, help=f"embedded bootstrap server port {d}")
    p.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=("mooncake", "fake"),
                   help=f"KV data plane {d}")
    p.add_argument("--page-size", type=int, default=16, help=f"tokens per KV page {d}")
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help=f"most prompt tokens of one request per forward; <= 0 disables chunking {d}")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help=f"most prompt tokens per forward {d}")
    p.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"), help=f"waiting queue order {d}")
    p.add_argument("--mem-fraction-static", type=float, default=0.8, help=f"GPU memory fraction for the KV pool {d}")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from free memory)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help=f"request rows: prompts being computed plus transfers in flight {d}")
    p.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    return p


def config_from_args(ns: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        role="prefill",
        model=ModelConfig(model_path=ns.model_path, tokenizer_path=ns.tokenizer_path,
                          served_model_name=ns.served_model_name, dtype=ns.dtype, device=ns.device,
                          context_length=ns.context_length),
        cache=CacheConfig(page_size=ns.page_size, mem_fraction_static=ns.mem_fraction_static,
                          max_total_tokens=ns.max_total_tokens, max_running_requests=ns.max_running_requests,
                          enable_prefix_cache=not ns.disable_radix_cache),
        sched=SchedulerConfig(chunked_prefill_size=ns.chunked_prefill_size, max_prefill_tokens=ns.max_prefill_tokens,
                              schedule_policy=ns.schedule_policy),
        attention=AttentionConfig(backend=ns.attention_backend),
        transfer=TransferConfig(backend=ns.disaggregation_transfer_backend, bootstrap_port=ns.disaggregation_bootstrap_port),
        server=ServerConfig(host=ns.host, port=ns.port),
    )


def _wait_ready(proc: mp.process.BaseProcess, conn: Connection, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                kind, payload = conn.recv()
            except EOFError as exc:
                raise StartupError(f"the scheduler process exited during start-up (status {proc.exitcode})") from exc
            if kind == "ready":
                return payload
            raise StartupError(f"the scheduler failed to start: {payload}")
        if not proc.is_alive():
            raise StartupError(f"the scheduler process exited during start-up (status {proc.exitcode})")
    raise StartupError(f"the scheduler did not become ready within {timeout_s:g} s")


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop(proc: mp.process.BaseProcess) -> None:
    if proc.pid is None or not proc.is_alive():
        return
    proc.terminate()
    proc.join(STOP_GRACE_S)
    if proc.is_alive():
        log.warning("scheduler %d ignored SIGTERM for %g s; killing it", proc.pid, STOP_GRACE_S)
        proc.kill()
        proc.join(5.0)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(asctime)s %(levelname)s prefill %(name)s: %(message)s")
    try:
        cfg = resolve(config_from_args(ns))
        api_cfg = ApiConfig.from_node_config(cfg)
        api_cfg.validate()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    from bootstrap_server.client import bootstrap_url
    from bootstrap_server.server import BootstrapServer
    from common.server import run_api_server

    endpoints = IpcEndpoints.fresh()
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or ZMQ state
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler, name="pdc-prefill-scheduler",
                       args=(cfg, PrefillOptions(), endpoints, bootstrap_url(ns.host, cfg.transfer.bootstrap_port), send_end))

    def scheduler_alive() -> bool:
        # is_alive() reaps a dead child; a pid probe (os.kill(pid, 0)) would see a zombie as alive.
        return proc.pid is not None and proc.is_alive()

    boot = BootstrapServer(ns.host, cfg.transfer.bootstrap_port, health_check=scheduler_alive)
    # Until uvicorn installs its own handlers, SIGTERM must still run the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        boot.start()
    except OSError as exc:
        log.error("cannot serve the bootstrap registry on %s:%d: %s", ns.host, cfg.transfer.bootstrap_port, exc)
        return 1
    try:
        proc.start()
        send_end.close()  # the child holds the only writer: EOF on our end means it died
        info = _wait_ready(proc, recv_end, STARTUP_TIMEOUT_S)
        log.info("scheduler %d ready (%s); serving HTTP on %s:%d, bootstrap on %d", info["pid"],
                 info["control_endpoint"], ns.host, ns.port, cfg.transfer.bootstrap_port)
        api_cfg = replace(api_cfg, server_info_extra={**api_cfg.server_info_extra,
                                                      "max_total_tokens": info["max_total_tokens"],
                                                      "scheduler_pid": info["pid"]})
        run_api_server(api_cfg, endpoints, scheduler_alive=scheduler_alive)
        return 0
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop(proc)
        boot.stop()
        for addr in (endpoints.to_scheduler, endpoints.from_scheduler):
            with contextlib.suppress(OSError):
                os.unlink(addr.removeprefix("ipc://"))

