"""Launch a decode node: ``pdcluster decode ...`` or ``python -m decode_node ...``.

Two processes: this one serves HTTP (the shared API app) and starts the scheduler process
(``decode_node.process``), linked by two ZMQ ipc sockets. HTTP is served only once the scheduler
reported ready (model loaded, pools and KV manager up); a start-up failure exits with status 1 and
the reason. If the scheduler dies later the API process shuts down too (status 1), so a
supervisor sees one failed node instead of a zombie half.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
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
from common.server.launch import pid_alive, run_api_server
from decode_node.process import DecodeOptions, run_scheduler

log = logging.getLogger("decode_node")

STARTUP_TIMEOUT_S = 900.0  # loading a big checkpoint onto a GPU can take minutes
STOP_GRACE_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster decode", description="run a decode node (API + scheduler)")
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--tokenizer-path", help="default: --model-path")
    p.add_argument("--served-model-name", help="model name reported by the API (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address; also what prefill nodes reach us on")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--disaggregation-transfer-backend", choices=("mooncake", "fake"), default="mooncake")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill bootstrap port assumed when a request names none")
    p.add_argument("--page-size", type=int, default=CacheConfig.page_size, help="must equal the prefill's")
    p.add_argument("--max-running-requests", type=int, default=CacheConfig.max_running_requests)
    p.add_argument("--mem-fraction-static", type=float, default=CacheConfig.mem_fraction_static)
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: from free memory / CPU default)")
    p.add_argument("--num-reserved-decode-tokens", type=int, default=DecodeOptions.reserved_decode_tokens,
                   help="KV headroom kept per running request when admitting new rooms")
    p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="scales the decode headroom ratio (new_token_ratio); < 1 admits more rooms and retracts more")
    p.add_argument("--context-length", type=int)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    return p


def _sched_config(conservativeness: float) -> SchedulerConfig:
    """SGLang's --schedule-conservativeness: both ends of the new_token_ratio schedule scale with it."""
    if conservativeness <= 0:
        raise ConfigError(f"--schedule-conservativeness must be > 0, got {conservativeness}")
    base = SchedulerConfig()
    init = min(base.new_token_ratio_init * conservativeness, 1.0)
    return replace(base, new_token_ratio_init=init, new_token_ratio_min=min(base.new_token_ratio_min * conservativeness, init))


def config_from_args(a: argparse.Namespace) -> tuple[NodeConfig, DecodeOptions]:
    cfg = NodeConfig(
        role="decode",
        model=ModelConfig(model_path=a.model_path, tokenizer_path=a.tokenizer_path, served_model_name=a.served_model_name,
                          dtype=a.dtype, device=a.device, context_length=a.context_length),
        cache=CacheConfig(page_size=a.page_size, mem_fraction_static=a.mem_fraction_static,
                          max_total_tokens=a.max_total_tokens, max_running_requests=a.max_running_requests,
                          enable_prefix_cache=False),
        sched=_sched_config(a.schedule_conservativeness),
        attention=AttentionConfig(backend=a.attention_backend),
        transfer=TransferConfig(backend=a.disaggregation_transfer_backend, bootstrap_port=a.disaggregation_bootstrap_port),
        server=ServerConfig(host=a.host, port=a.port),
    )
    if a.num_reserved_decode_tokens < 1:
        raise ConfigError(f"--num-reserved-decode-tokens must be >= 1, got {a.num_reserved_decode_tokens}")
    return resolve(cfg), DecodeOptions(reserved_decode_tokens=a.num_reserved_decode_tokens)


def _wait_ready(proc: multiprocessing.process.BaseProcess, conn: Connection, timeout_s: float) -> dict:
    """The scheduler's start-up report; RuntimeError naming why it failed or timed out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                kind, payload = conn.recv()
            except EOFError as exc:
                raise RuntimeError(f"the scheduler process exited during start-up (status {proc.exitcode})") from exc
            if kind == "ready":
                return payload
            raise RuntimeError(f"the scheduler failed to start: {payload}")
        if not proc.is_alive():
            raise RuntimeError(f"the scheduler process exited during start-up (status {proc.exitcode})")
    raise RuntimeError(f"the scheduler did not become ready within {timeout_s:g} s")


def _watch_scheduler(proc: multiprocessing.process.BaseProcess, stopping: threading.Event, died: threading.Event) -> None:
    proc.join()
    if not stopping.is_set():
        died.set()
        log.error("the decode scheduler process exited (status %s); shutting the node down", proc.exitcode)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: graceful shutdown of the API


def _stop(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(STOP_GRACE_S)
    if proc.is_alive():
        log.warning("scheduler %s ignored SIGTERM for %g s; killing it", proc.pid, STOP_GRACE_S)
        proc.kill()
        proc.join(5.0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(asctime)s %(levelname)s decode-api %(name)s: %(message)s")
    try:
        cfg, opts = config_from_args(args)
        api_cfg = ApiConfig.from_node_config(cfg)
        api_cfg.validate()
    except ConfigError as exc:
        print(f"pdcluster decode: {exc}", file=sys.stderr)
        return 2
    endpoints = IpcEndpoints.fresh()
    ctx = multiprocessing.get_context("spawn")  # not fork: the child builds its own torch / ZMQ / Mooncake state
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler, args=(cfg, opts, endpoints, send_end), name="pdc-decode-scheduler")
    stopping, died = threading.Event(), threading.Event()
    try:
        proc.start()
        send_end.close()  # the child holds the only writer: EOF on our end means it died
        info = _wait_ready(proc, recv_end, STARTUP_TIMEOUT_S)
        log.info("decode scheduler %d ready; serving HTTP on %s:%d", info["pid"], args.host, args.port)
        threading.Thread(target=_watch_scheduler, args=(proc, stopping, died), daemon=True).start()
        api_cfg = replace(api_cfg, server_info_extra={**api_cfg.server_info_extra,
                                                      "max_total_tokens": info["max_total_tokens"]})
        run_api_server(api_cfg, endpoints, scheduler_alive=pid_alive(info["pid"]))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        stopping.set()
        _stop(proc)
        for addr in (endpoints.to_scheduler, endpoints.from_scheduler):
            with contextlib.suppress(OSError):
                os.unlink(addr.removeprefix("ipc://"))
    return 1 if died.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
