"""``python -m router`` / ``pdcluster router``: our least-loaded PD router (see router/app.py)."""
from __future__ import annotations

import logging
import sys

from aiohttp import web

from router.app import create_app, serve_options
from router.clients import KeysFileError
from router.config import ConfigError, parse_config

SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long after SIGTERM


def _event_loop():  # type: ignore[no-untyped-def]
    """uvloop where installed (it is in every lock): the router is all socket I/O, and uvloop's
    loop costs less CPU per proxied chunk than the stock one. Without it, aiohttp's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"pdcluster router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not cfg.workers:
        logging.getLogger("router").warning("no workers given: add them with POST /workers")
    try:
        options = serve_options(cfg)
        app = create_app(cfg)
    except (ConfigError, KeysFileError) as exc:  # a certificate or keys file that does not load
        print(f"pdcluster router: {exc}", file=sys.stderr)
        return 2
    web.run_app(app, host=cfg.host, port=cfg.port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S, loop=_event_loop(), **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
