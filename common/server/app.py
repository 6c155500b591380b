"""FastAPI app factory shared by the prefill and decode nodes (the worker HTTP API, docs/PROTOCOL.md).

``create_app`` only assembles: the scheduler client's lifespan, the access check, the error
handlers, and the routes, which live one group per module, each adding its own from one
``AppContext`` (common/server/context.py)::

    routes_generate   POST /generate (and the parse-then-serve step all generation shares)
    routes_openai     POST /v1/completions, /v1/chat/completions; GET /v1/models
    routes_info       GET /health, /health_generate, /server_info, /model_info (+ /get_… aliases)
    routes_admin      GET /get_load, /debug/memory, /metrics; GET|POST /flush_cache; POST /abort_request

Generation endpoints parse and validate (400 before anything reaches the scheduler), then hand
over to ``generation.serve``. Ops endpoints answer from config or from a scheduler query.
With ``cfg.cluster_secret`` every route but /health needs it (common/server/auth.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.server import routes_admin, routes_generate, routes_info, routes_openai
from common.server.auth import RequireClusterSecret
from common.server.config import ApiConfig
from common.server.context import VERSION, AppContext
from common.server.errors import ApiError, error_response
from common.server.metrics import ApiMetrics
from common.ipc.scheduler_client import SchedulerClient
from common.server.textio import TokenizerLike

logger = logging.getLogger(__name__)

ROUTE_MODULES = (routes_generate, routes_openai, routes_info, routes_admin)


def create_app(cfg: ApiConfig, scheduler: SchedulerClient, tokenizer: TokenizerLike) -> FastAPI:
    cfg.validate()
    metrics = ApiMetrics(cfg.role, cfg.model_name)
    ctx = AppContext(cfg=cfg, scheduler=scheduler, tokenizer=tokenizer, metrics=metrics, registry={},
                     started=time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.close()

    app = FastAPI(title="pdcluster node", version=VERSION, lifespan=lifespan)
    app.state.cfg, app.state.scheduler, app.state.tokenizer, app.state.metrics = cfg, scheduler, tokenizer, metrics
    if cfg.cluster_secret is not None:
        app.add_middleware(RequireClusterSecret, secret=cfg.cluster_secret)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the API process")
        return error_response(500, f"internal error in the API process: {type(exc).__name__}: {exc}")

    for routes in ROUTE_MODULES:
        routes.register(app, ctx)
    return app
