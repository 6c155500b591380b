"""The router's front-door check: with an API key configured, every endpoint but the probes
requires ``Authorization: Bearer <api key>`` (what OpenAI clients send) and answers 401 in the
OpenAI error shape otherwise.

    /health, /readiness, /liveness   open (Kubernetes probes carry no credentials)
    everything else                  the API key: generation, /v1/models, /workers (add, drain),
                                     /flush_cache, /abort_request, info pass-through, /metrics

One key for clients and operators alike: whoever may send requests may also drain a worker.
The key never travels further: requests to the nodes carry the cluster secret instead.
"""
from __future__ import annotations

import logging

from aiohttp import web

from common.auth import WWW_AUTHENTICATE, RefusalLog, bearer_matches
from router.forward import error_body

OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness"})

log = logging.getLogger("router.auth")


def require_api_key(api_key: str):  # type: ignore[no-untyped-def]
    """aiohttp middleware enforcing ``api_key`` on every path outside ``OPEN_PATHS``."""
    refusals = RefusalLog(log, "a client request without a valid API key")

    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path in OPEN_PATHS or bearer_matches(request.headers.get("Authorization"), api_key):
            return await handler(request)
        given = "no" if "Authorization" not in request.headers else "a wrong"
        refusals.refused(f"{request.method} {request.path} from {request.remote} with {given} Authorization header")
        body = error_body(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
        return web.json_response(body, status=401, headers={"WWW-Authenticate": WWW_AUTHENTICATE})

    return middleware
