"""The node's access check: with a cluster secret, every route but ``/health`` needs
``Authorization: Bearer <cluster secret>`` and answers 401 (OpenAI's error shape) without it.

    /health                  open: Kubernetes probes carry no credentials
    everything else          the secret: generation (/generate, /v1/*), /abort_request,
                             /flush_cache, /debug/*, /metrics, /get_load, info, /health_generate

Generation needs it too: a node reachable by a stranger would otherwise let them bypass the
router's API key. The router sends the secret on every request; sglang-router 0.3.2 does too
when started with ``--api-key <cluster secret>`` (it sends its key to workers as a bearer token).

A plain ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``, which would wrap every
streamed response in a task of its own and hide client disconnects from the generation code.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from common.auth import WWW_AUTHENTICATE, RefusalLog, bearer_matches
from common.server.errors import error_response

OPEN_PATHS = frozenset({"/health"})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)


class RequireClusterSecret:
    def __init__(self, app: ASGIApp, secret: str) -> None:
        self._app = app
        self._secret = secret
        self._refusals = RefusalLog(log, "a request without the cluster secret")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is not None and bearer_matches(header.decode("latin-1"), self._secret):
            await self._app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        given = "no" if header is None else "a wrong"
        self._refusals.refused(f"{scope['method']} {scope['path']} from {client[0]} with {given} Authorization header")
        resp = error_response(401, "this node requires the cluster secret: send 'Authorization: Bearer <secret>'")
        resp.headers["WWW-Authenticate"] = WWW_AUTHENTICATE
        await resp(scope, receive, send)
