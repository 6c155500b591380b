"""The router's front-door checks: who may call what.

    /health, /readiness, /liveness   open (Kubernetes probes carry no credentials)
    operator endpoints               the operator key: POST and DELETE /workers (add, drain),
                                     POST /flush_cache, POST /abort_request (one rid or every
                                     stream); a client key there is a 403, no key a 401
    everything else                  a client key (the API key) or the operator key:
                                     generation, /v1/models, GET /workers, info, /metrics,
                                     the dashboard (open when no API key is set)

``Authorization: Bearer <key>`` (what OpenAI clients send); 401 in the OpenAI error shape
otherwise. Without an operator key the operator endpoints are open only where the whole router
is (no API key either); with an API key but no operator key they are refused to everyone (403),
so a client key never drains a worker, redirects traffic or aborts other clients' streams.
Neither key travels further: requests to the nodes carry request tokens made from the cluster
secret instead (router/node_auth.py).
"""
from __future__ import annotations

import logging

from aiohttp import web

from common.auth import WWW_AUTHENTICATE, RefusalLog, bearer_matches
from router.forward import error_body

OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness"})
OPERATOR_ROUTES = frozenset({("POST", "/workers"), ("DELETE", "/workers"), ("POST", "/flush_cache"),
                             ("POST", "/abort_request")})

log = logging.getLogger("router.auth")


def require_keys(api_key: str | None, operator_key: str | None):  # type: ignore[no-untyped-def]
    """aiohttp middleware: the operator key on ``OPERATOR_ROUTES``, a client or operator key on
    every other path outside ``OPEN_PATHS``. Call only with at least one key."""
    assert api_key or operator_key
    refusals = RefusalLog(log, "a request without a valid key")

    def refuse(request: web.Request, status: int, message: str) -> web.Response:
        given = "no" if "Authorization" not in request.headers else "a wrong"
        refusals.refused(f"{request.method} {request.path} from {request.remote} with {given} Authorization "
                         f"header ({status})")
        headers = {"WWW-Authenticate": WWW_AUTHENTICATE} if status == 401 else None
        return web.json_response(error_body(status, message), status=status, headers=headers)

    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        is_operator = operator_key is not None and bearer_matches(header, operator_key)
        is_client = api_key is not None and bearer_matches(header, api_key)
        if (request.method, request.path) in OPERATOR_ROUTES:
            if is_operator:
                return await handler(request)
            if is_client:
                why = ("this endpoint needs the operator key (--operator-key), not a client key" if operator_key
                       else "this router has no operator key (--operator-key): its operator endpoints are off")
                return refuse(request, 403, why)
            return refuse(request, 401, "missing or invalid operator key: send 'Authorization: Bearer <operator key>'")
        if is_client or is_operator or api_key is None:  # no API key: the client endpoints are open
            return await handler(request)
        return refuse(request, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'")

    return middleware
