"""Start a node's API process: tokenizer + SchedulerClient + app on uvicorn.

The node launcher (``common.node.launch.run_node``, both roles) calls ``run_api_server`` in the
process that should serve HTTP, once their scheduler is ready; it blocks until shutdown. There is
no API-only entry point: tests/integration/_api_process.py calls ``run_api_server`` the same way.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from common import envs
from common.cpu_budget import limit_api_process
from common.ipc.protocol import IpcEndpoints
from common.server.app import create_app
from common.server.config import ApiConfig
from common.server.limits import head_timeout_protocol
from common.ipc.scheduler_client import SchedulerClient
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
    # graceful shutdown: a long stream must not keep a stopping node alive. uvicorn has no header
    # timeout of its own (a slowloris client held a connection forever): the protocol adds one.
    # TLS: uvicorn's own; with a CA the handshake refuses a client without a certificate it
    # signed, before any route (/health included) sees a byte.
    tls = {} if cfg.ssl_certfile is None else {
        "ssl_certfile": cfg.ssl_certfile, "ssl_keyfile": cfg.ssl_keyfile, "ssl_ca_certs": cfg.ssl_ca_certs,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if cfg.ssl_ca_certs else ssl.CERT_NONE}
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=level, access_log=False, timeout_keep_alive=60,
                timeout_graceful_shutdown=5, http=head_timeout_protocol(AutoHTTPProtocol, cfg.header_timeout_s), **tls)
