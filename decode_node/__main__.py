"""Launch a decode node: ``pdcluster decode ...`` or ``python -m decode_node ...``.

Two processes: this one serves HTTP (the shared API app) and starts the scheduler process
(``decode_node.process``), linked by two ZMQ ipc sockets. If the scheduler dies the API process
shuts down too (exit status 1), so a supervisor sees one failed node instead of a zombie half.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import threading

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
from decode_node.process import DecodeOptions, run_scheduler

log = logging.getLogger("decode_node")


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
    p.add_argument("--context-length", type=int)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    return p


def config_from_args(a: argparse.Namespace) -> tuple[NodeConfig, DecodeOptions]:
    cfg = NodeConfig(
        role="decode",
        model=ModelConfig(model_path=a.model_path, tokenizer_path=a.tokenizer_path, served_model_name=a.served_model_name,
                          dtype=a.dtype, device=a.device, context_length=a.context_length),
        cache=CacheConfig(page_size=a.page_size, mem_fraction_static=a.mem_fraction_static,
                          max_total_tokens=a.max_total_tokens, max_running_requests=a.max_running_requests,
                          enable_prefix_cache=False),
        sched=SchedulerConfig(),
        attention=AttentionConfig(backend=a.attention_backend),
        transfer=TransferConfig(backend=a.disaggregation_transfer_backend, bootstrap_port=a.disaggregation_bootstrap_port),
        server=ServerConfig(host=a.host, port=a.port),
    )
    if a.num_reserved_decode_tokens < 1:
        raise ConfigError(f"--num-reserved-decode-tokens must be >= 1, got {a.num_reserved_decode_tokens}")
    return resolve(cfg), DecodeOptions(reserved_decode_tokens=a.num_reserved_decode_tokens)


def _watch_scheduler(proc: multiprocessing.process.BaseProcess, stopping: threading.Event, died: threading.Event) -> None:
    proc.join()
    if not stopping.is_set():
        died.set()
        log.error("the decode scheduler process exited (status %s); shutting the node down", proc.exitcode)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: graceful shutdown of the API


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(asctime)s %(levelname)s decode-api %(name)s: %(message)s")
    try:
        cfg, opts = config_from_args(args)
        from common.server.config import ApiConfig

        api_cfg = ApiConfig.from_node_config(cfg)
        api_cfg.validate()
    except ConfigError as exc:
        print(f"pdcluster decode: {exc}", file=sys.stderr)
        return 2
    endpoints = IpcEndpoints.fresh()
    # spawn, not fork: the child builds its own torch / ZMQ / Mooncake state from scratch.
    proc = multiprocessing.get_context("spawn").Process(
        target=run_scheduler, args=(cfg, opts, endpoints), name="pdc-decode-scheduler")
    proc.start()
    stopping, died = threading.Event(), threading.Event()
    threading.Thread(target=_watch_scheduler, args=(proc, stopping, died), daemon=True).start()
    from common.server.launch import pid_alive, run_api_server

    try:
        run_api_server(api_cfg, endpoints, scheduler_alive=pid_alive(proc.pid))  # type: ignore[arg-type]
    finally:
        stopping.set()
        if proc.is_alive():
            proc.terminate()
            proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return 1 if died.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
