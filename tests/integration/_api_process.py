"""A node's API process alone, for API-process tests: what a node launcher runs once its scheduler
is ready (``run_api_server``), here linked to whatever scheduler listens on the given ipc sockets
(tests/integration/_fake_scheduler.py)::

    python tests/integration/_api_process.py --role decode|prefill --model-path DIR --port P
        --to-scheduler ipc://... --from-scheduler ipc://... [--scheduler-pid PID] ...

The node launcher (common/node/launch.py, both roles) builds the ApiConfig from its node
flags and watch their own child; this helper reads the model directory (``ApiConfig.for_model_dir``)
and, given ``--scheduler-pid``, watches that pid as the launchers watch their child: requests fail
with 503 once it is gone.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common import envs  # noqa: E402
from common.ipc.protocol import IpcEndpoints  # noqa: E402
from common.server import ApiConfig, pid_alive, run_api_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a node's API process alone")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--to-scheduler", required=True, help="ipc address the scheduler PULLs from")
    p.add_argument("--from-scheduler", required=True, help="ipc address this process PULLs from")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--health-generate-timeout", type=float, default=20.0)
    p.add_argument("--scheduler-pid", type=int, help="fail requests with 503 once this pid is gone")
    p.add_argument("--max-payload-size", type=int, help="largest body (default: from the context length)")
    p.add_argument("--header-timeout-s", type=float, default=ApiConfig.header_timeout_s)
    p.add_argument("--body-timeout-s", type=float, default=ApiConfig.body_timeout_s)
    p.add_argument("--max-n", type=int, default=ApiConfig.max_n)
    p.add_argument("--ssl-certfile")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--ssl-ca-certs")
    args = p.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ApiConfig.for_model_dir(args.role, args.model_path, port=args.port,
                                  bootstrap_port=args.disaggregation_bootstrap_port,
                                  health_generate_timeout_s=args.health_generate_timeout,
                                  max_payload_size=args.max_payload_size, header_timeout_s=args.header_timeout_s,
                                  body_timeout_s=args.body_timeout_s, max_n=args.max_n,
                                  ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                                  ssl_ca_certs=args.ssl_ca_certs)
    alive = pid_alive(args.scheduler_pid) if args.scheduler_pid else None
    run_api_server(cfg, IpcEndpoints(args.to_scheduler, args.from_scheduler), scheduler_alive=alive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
