"""Launch a decode node: ``pdcluster decode ...`` or ``python -m decode_node ...``.

Two processes: this one serves HTTP (the shared API app) and starts the scheduler process
(``decode_node.process``), linked by two ZMQ ipc sockets. HTTP is served only once the scheduler
reported ready (model loaded, pools and KV manager up); a start-up failure exits with status 1 and
the reason. If the scheduler dies later the API process shuts down too (status 1), so a
supervisor sees one failed node instead of a zombie half.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import replace

from common import envs
from common.config import ConfigError, NodeConfig, SchedulerConfig, resolve
from common.ipc.protocol import IpcEndpoints
from common.server.config import ApiConfig
from common.server.launch import run_api_server
from common.server.node_launch import (
    SchedulerChild,
    StartupError,
    add_node_flags,
    attention_config,
    cpu_slice,
    cache_config,
    model_config,
    server_config,
    transfer_config,
)
from decode_node.process import run_scheduler

log = logging.getLogger("decode_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster decode", description="run a decode node (API + scheduler)")
    add_node_flags(p, port=30001)
    p.add_argument("--num-reserved-decode-tokens", type=int, default=SchedulerConfig.reserved_decode_tokens,
                   help="KV headroom kept per running request when admitting new rooms")
    p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="scales the decode headroom ratio (new_token_ratio); < 1 admits more rooms and retracts more")
    return p


def _sched_config(conservativeness: float, reserved_decode_tokens: int) -> SchedulerConfig:
    """SGLang's --schedule-conservativeness: both ends of the new_token_ratio schedule scale with it."""
    if conservativeness <= 0:
        raise ConfigError(f"--schedule-conservativeness must be > 0, got {conservativeness}")
    base = SchedulerConfig()
    init = min(base.new_token_ratio_init * conservativeness, 1.0)
    return replace(base, new_token_ratio_init=init, new_token_ratio_min=min(base.new_token_ratio_min * conservativeness, init),
                   reserved_decode_tokens=reserved_decode_tokens)


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        role="decode",
        model=model_config(a),
        cache=cache_config(a, enable_prefix_cache=False),
        sched=_sched_config(a.schedule_conservativeness, a.num_reserved_decode_tokens),
        attention=attention_config(a),
        transfer=transfer_config(a),
        server=server_config(a),
        cpu=cpu_slice(a),
    )


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
        cfg = resolve(config_from_args(args))
        api_cfg = ApiConfig.from_node_config(cfg)
        api_cfg.validate()
    except ConfigError as exc:
        print(f"pdcluster decode: {exc}", file=sys.stderr)
        return 2
    endpoints = IpcEndpoints.fresh()
    child = SchedulerChild(run_scheduler, (cfg, endpoints), "pdc-decode-scheduler", endpoints)
    stopping, died = threading.Event(), threading.Event()
    try:
        child.start()
        info = child.wait_ready()
        log.info("decode scheduler %d ready (CPU %s); serving HTTP on %s:%d", info["pid"], info["cpu"], args.host,
                 args.port)
        threading.Thread(target=_watch_scheduler, args=(child.proc, stopping, died), daemon=True).start()
        api_cfg = replace(api_cfg, server_info_extra={**api_cfg.server_info_extra,
                                                      "max_total_tokens": info["max_total_tokens"],
                                                      "scheduler_pid": info["pid"], "cpu": info["cpu"]})
        run_api_server(api_cfg, endpoints, scheduler_alive=child.alive)
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    finally:
        stopping.set()
        child.stop()
    return 1 if died.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
