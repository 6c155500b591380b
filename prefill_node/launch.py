"""Launch a prefill node: bootstrap server + scheduler process + API process (this one).

::

    pdcluster prefill --model-path DIR [--host H --port P --disaggregation-bootstrap-port B
                      --disaggregation-transfer-backend mooncake|fake --page-size N ...]

    this process                                       child (spawned)
    ------------                                       ---------------
    1. BootstrapServer on B (thread)   <-- PUT /route --  PrefillKVManager registers its rank
    2. spawn scheduler, wait for "ready" <-- pipe -----   model loaded, pools built, rank registered
    3. uvicorn: FastAPI app  <== ZMQ ipc (common.ipc.protocol) ==>  scheduler loop
    4. on exit: SIGTERM the scheduler (SIGKILL after a grace period), stop the bootstrap server

Start-up fails fast with exit status 1 and the reason when the scheduler cannot start (bad model,
port taken, mooncake missing), instead of serving 503s forever. ``/health`` stays 503 until the
scheduler has answered, and turns 503 again if it dies (the API watches its pid).
"""
from __future__ import annotations

import argparse
import logging
import signal
from dataclasses import replace

from common import envs
from common.config import ConfigError, NodeConfig, SchedulerConfig, resolve
from common.ipc.protocol import IpcEndpoints
from common.server.config import ApiConfig
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
from prefill_node.process import run_scheduler

log = logging.getLogger("prefill_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster prefill", description="Run a prefill node (flags mirror SGLang's).")
    d = "(default: %(default)s)"
    add_node_flags(p, port=30000)
    p.add_argument("--chunked-prefill-size", type=int, default=SchedulerConfig.chunked_prefill_size,
                   help=f"most prompt tokens of one request per forward; <= 0 disables chunking {d}")
    p.add_argument("--max-prefill-tokens", type=int, default=SchedulerConfig.max_prefill_tokens,
                   help=f"most prompt tokens per forward {d}")
    p.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"), help=f"waiting queue order {d}")
    p.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    return p


def config_from_args(ns: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        role="prefill",
        model=model_config(ns),
        cache=cache_config(ns, enable_prefix_cache=not ns.disable_radix_cache),
        sched=SchedulerConfig(chunked_prefill_size=ns.chunked_prefill_size, max_prefill_tokens=ns.max_prefill_tokens,
                              schedule_policy=ns.schedule_policy),
        attention=attention_config(ns),
        transfer=transfer_config(ns),
        server=server_config(ns),
        cpu=cpu_slice(ns),
    )


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


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
    child = SchedulerChild(run_scheduler, (cfg, endpoints, bootstrap_url(ns.host, cfg.transfer.bootstrap_port)),
                           "pdc-prefill-scheduler", endpoints)
    boot = BootstrapServer(ns.host, cfg.transfer.bootstrap_port, health_check=child.alive,
                           secret=cfg.transfer.cluster_secret)
    # Until uvicorn installs its own handlers, SIGTERM must still run the cleanup below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        boot.start()
    except OSError as exc:
        log.error("cannot serve the bootstrap registry on %s:%d: %s", ns.host, cfg.transfer.bootstrap_port, exc)
        return 1
    try:
        child.start()
        info = child.wait_ready()
        log.info("scheduler %d ready (%s, CPU %s); serving HTTP on %s:%d, bootstrap on %d", info["pid"],
                 info["control_endpoint"], info["cpu"], ns.host, ns.port, cfg.transfer.bootstrap_port)
        api_cfg = replace(api_cfg, server_info_extra={**api_cfg.server_info_extra,
                                                      "max_total_tokens": info["max_total_tokens"],
                                                      "scheduler_pid": info["pid"], "cpu": info["cpu"]})
        run_api_server(api_cfg, endpoints, scheduler_alive=child.alive)
        return 0
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    finally:
        child.stop()
        boot.stop()
