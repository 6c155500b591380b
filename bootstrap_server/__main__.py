"""Standalone bootstrap registry: ``python -m bootstrap_server --host H --port P``.

``main(argv)`` is also what ``pdcluster bootstrap`` calls. It serves until SIGINT or SIGTERM,
then closes the listener and returns 0; it returns 1 when the port cannot be bound. Bad flags
exit with status 2 (argparse's ``SystemExit``). With a cluster secret (``--cluster-secret``,
``--cluster-secret-file`` or ``PDC_CLUSTER_SECRET``) every route but ``GET /health`` requires a request
token made from it; without one it listens only on a loopback address unless ``--insecure``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from bootstrap_server.server import DEFAULT_LIMITS, AsyncBootstrapServer
from common import envs
from common.aio_body import BodyLimits
from common.auth import SecretError, check_exposure, resolve_secret
from common.http_limits import HEADER_TIMEOUT_S

logger = logging.getLogger("bootstrap_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster bootstrap", description="Prefill rank registry (PUT/GET /route, /health).")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 to serve other machines (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8998, help="port to listen on, 0 for any free port (default: %(default)s)")
    parser.add_argument("--log-level", default=None, help="log level (default: PDC_LOG_LEVEL or INFO)")
    parser.add_argument("--cluster-secret", help="require a request token made from it on every route but /health "
                        "(default: PDC_CLUSTER_SECRET; none: open, and only on a loopback --host unless --insecure)")
    parser.add_argument("--cluster-secret-file", metavar="PATH", help="read the cluster secret from this file")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="listen on a non-loopback --host without a secret (default: PDC_INSECURE)")
    parser.add_argument("--header-timeout-s", type=float, default=HEADER_TIMEOUT_S,
                        help="close a connection whose request head has not arrived this long after it opened or "
                             "after its last response (default: %(default)s)")
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULT_LIMITS.timeout_s,
                        help="a request body not in this long is a 408 (default: %(default)s)")
    return parser


async def _serve(host: str, port: int, secret: str | None, header_timeout_s: float, body_timeout_s: float) -> None:
    limits = BodyLimits(DEFAULT_LIMITS.max_bytes, body_timeout_s)
    server = AsyncBootstrapServer(host, port, secret=secret, limits=limits, header_timeout_s=header_timeout_s)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        build_parser().error(f"--port {args.port} out of range")
    if not (args.header_timeout_s > 0 and args.body_timeout_s > 0):
        build_parser().error("--header-timeout-s and --body-timeout-s must be > 0")
    level = (args.log_level or envs.LOG_LEVEL.get()).upper()
    if not isinstance(logging.getLevelName(level), int):
        build_parser().error(f"--log-level {level!r}: expected DEBUG, INFO, WARNING or ERROR")
    try:
        secret = resolve_secret(args.cluster_secret, args.cluster_secret_file, envs.CLUSTER_SECRET, "--cluster-secret")
        check_exposure(args.host, secret, envs.INSECURE.get() if args.insecure is None else args.insecure,
                       "bootstrap registry")
    except SecretError as exc:
        build_parser().error(str(exc))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(args.host, args.port, secret, args.header_timeout_s, args.body_timeout_s))
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
