"""The router's front-door checks: who may call what.

    /health, /readiness, /liveness   open (Kubernetes probes carry no credentials)
    operator endpoints               the operator key: POST and DELETE /workers (add, drain),
                                     POST /flush_cache, POST /abort_request (one rid or every
                                     stream); a client key there is a 403, no key a 401
    everything else                  a client key or an operator key: generation, /v1/models,
                                     GET /workers, info, /metrics, the dashboard (open when no
                                     client key exists); a client only within its endpoints and
                                     its rate limits (router/clients.py), else 403 / 429

``Authorization: Bearer <key>`` (what OpenAI clients send); 401 in the OpenAI error shape
otherwise. Keys come from ``--api-key`` (a client), ``--operator-key`` (an operator) and the
``--keys-file`` (router/clients.py). Without any operator the operator endpoints are open only
where the whole router is; with a client key but no operator they are refused to everyone (403),
so a client key never drains a worker, redirects traffic or aborts other clients' streams.
Neither key travels further: requests to the nodes carry request tokens made from the cluster
secret instead (router/node_auth.py).
"""
from __future__ import annotations

import logging

from aiohttp import web

from common.auth import WWW_AUTHENTICATE, RefusalLog
from router.clients import Clients, ClientSpec, retry_after
from router.forward import error_body

OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness"})
CLIENT = web.RequestKey("client", ClientSpec)  # who called, for the handlers (None: no key matched)
OPERATOR_ROUTES = frozenset({("POST", "/workers"), ("DELETE", "/workers"), ("POST", "/flush_cache"),
                             ("POST", "/abort_request")})

log = logging.getLogger("router.auth")


def require_keys(clients: Clients):  # type: ignore[no-untyped-def]
    """aiohttp middleware: an operator's key on ``OPERATOR_ROUTES``, a client's or an operator's
    on every other path outside ``OPEN_PATHS`` (open when no client key exists at all), each
    client within its endpoints and its requests-per-minute bucket (router/clients.py). The
    caller's ``ClientSpec`` is left in ``request[CLIENT]`` for the handlers."""
    refusals = RefusalLog(log, "a request without a valid key")

    def refuse(request: web.Request, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        given = "no" if "Authorization" not in request.headers else "a wrong"
        refusals.refused(f"{request.method} {request.path} from {request.remote} with {given} Authorization "
                         f"header ({status})")
        if status == 401:
            headers = {"WWW-Authenticate": WWW_AUTHENTICATE, **(headers or {})}
        return web.json_response(error_body(status, message), status=status, headers=headers)

    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path in OPEN_PATHS:
            return await handler(request)
        client = clients.identify(request.headers.get("Authorization"))
        request[CLIENT] = client  # type: ignore[assignment]
        if (request.method, request.path) in OPERATOR_ROUTES:
            if client is not None and client.role == "operator":
                return await handler(request)
            if client is not None:
                why = ("this endpoint needs an operator key (--operator-key or an operator in --keys-file), "
                       "not a client key" if clients.has_operator else
                       "this router has no operator key (--operator-key): its operator endpoints are off")
                return refuse(request, 403, why)
            return refuse(request, 401, "missing or invalid operator key: send 'Authorization: Bearer <operator key>'")
        if client is None:
            if clients.has_client:
                return refuse(request, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
            return await handler(request)  # no client keys at all: the client endpoints are open
        if not client.may_call(request.path):
            return refuse(request, 403, f"the key of {client.name!r} may not call {request.path}")
        wait = clients.take(client, "requests", 1.0)
        if wait > 0:
            return refuse(request, 429, f"{client.name!r} is over its limit of {client.requests_per_min:g} "
                                        "requests per minute", {"Retry-After": retry_after(wait)})
        return await handler(request)

    return middleware
