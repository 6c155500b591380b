"""Start a node's API process: tokenizer + SchedulerClient + app on uvicorn.

Node launchers call ``run_api_server`` in the process that should serve HTTP (it blocks until
shutdown). ``python -m common.server`` does the same from flags, for tests and debugging.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

import uvicorn

from common import envs
from common.cpu_budget import limit_api_process
from common.protocol import IpcEndpoints
from common.server.app import create_app
from common.server.config import ApiConfig
from common.server.scheduler_client import SchedulerClient
from common.server.textio import TokenizerLike


def pid_alive(pid: int) -> Callable[[], bool]:
    """A liveness check for the scheduler's process id (signal 0 probes without signalling).

    A dead child that its parent has not reaped yet is a zombie: signal 0 still succeeds, so
    the process state in /proc is read too (where /proc exists).
    """

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # "pid (comm) state ...": comm may contain spaces, so split after the last ')'
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state not in (b"Z", b"X")

    return alive


def run_api_server(cfg: ApiConfig, endpoints: IpcEndpoints, tokenizer: TokenizerLike | None = None,
                   scheduler_alive: Callable[[], bool] | None = None) -> None:
    if tokenizer is None:
        from common.tokenizer import Tokenizer

        tokenizer = Tokenizer(cfg.tokenizer_path or cfg.model_path)
    limit_api_process()  # the model runs in the scheduler process; the API takes one torch thread
    client = SchedulerClient(endpoints.to_scheduler, endpoints.from_scheduler, scheduler_alive)
    app = create_app(cfg, client, tokenizer)
    level = envs.LOG_LEVEL.get().lower()
    # access_log off: one line per request costs more than the request on a tiny model. A bounded
    # graceful shutdown: a long stream must not keep a stopping node alive.
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=level, access_log=False, timeout_keep_alive=60,
                timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.server", description="a node's API process alone")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--context-length", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--to-scheduler", required=True, help="ipc address the scheduler PULLs from")
    p.add_argument("--from-scheduler", required=True, help="ipc address this process PULLs from")
    p.add_argument("--scheduler-pid", type=int, help="fail requests with 503 once this pid is gone")
    p.add_argument("--health-generate-timeout", type=float, default=20.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kw: dict = dict(tokenizer_path=args.tokenizer_path, served_model_name=args.served_model_name, host=args.host,
                    port=args.port, bootstrap_port=args.disaggregation_bootstrap_port,
                    health_generate_timeout_s=args.health_generate_timeout)
    if args.context_length:
        kw["context_length"] = args.context_length
    cfg = ApiConfig.for_model_dir(args.role, args.model_path, **kw)
    alive = pid_alive(args.scheduler_pid) if args.scheduler_pid else None
    run_api_server(cfg, IpcEndpoints(args.to_scheduler, args.from_scheduler), scheduler_alive=alive)
    return 0
