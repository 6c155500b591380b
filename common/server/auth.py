"""The node's access check: with a cluster secret, every route but ``/health`` needs a request
token made from it (common/auth.py) and answers 401 (OpenAI's error shape) without one.

    /health                  open: Kubernetes probes carry no credentials. With
                             ``?challenge=<nonce>`` the answer carries ``X-PDC-Proof``, the
                             router's evidence that this node holds the secret before it sends
                             the node anything else.
    everything else          a request token: generation (/generate, /v1/*), /abort_request,
                             /flush_cache, /debug/*, /metrics, /get_load, info, /health_generate

Generation needs it too: a node reachable by a stranger would otherwise let them bypass the
router's API key. A token covers the method, path, query and body, is good for one use within
``TOKEN_WINDOW_S``, so the body is read here in full before the route sees it (and handed on
unchanged). With ``accept_bearer`` (``--accept-bearer-secret``) the bare secret as a bearer token
is accepted too: what sglang-router 0.3.2 sends when started with ``--api-key <cluster secret>``.

A plain ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``, which would wrap every
streamed response in a task of its own and hide client disconnects from the generation code.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from common.auth import MAX_CHALLENGE_CHARS, PROOF_HEADER, WWW_AUTHENTICATE, RefusalLog, RequestVerifier, proof
from common.server.errors import error_response

OPEN_PATHS = frozenset({"/health"})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)


def _target(scope: Scope) -> str:
    path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


class RequireClusterSecret:
    def __init__(self, app: ASGIApp, secret: str, accept_bearer: bool = False) -> None:
        self._app = app
        self._secret = secret
        self._verifier = RequestVerifier(secret, accept_bearer=accept_bearer)
        self._refusals = RefusalLog(log, "a request without a valid cluster-secret token")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, self._with_proof(scope, send))
            return
        # The token covers the body: read it all, then hand the same bytes to the route.
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        reason = self._verifier.check(None if header is None else header.decode("latin-1"), scope["method"],
                                      _target(scope), body)
        if reason is None:
            replayed = False

            async def replay() -> MutableMapping[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self._app(scope, replay, send)
            return
        client = scope.get("client") or ("?", 0)
        self._refusals.refused(f"{scope['method']} {scope['path']} from {client[0]}: {reason}")
        resp = error_response(401, "this node requires a request token made from the cluster secret "
                                   "(our router sends one; see docs/OPERATIONS.md, access control)")
        resp.headers["WWW-Authenticate"] = WWW_AUTHENTICATE
        await resp(scope, receive, send)

    def _with_proof(self, scope: Scope, send: Send) -> Send:
        """``send`` that adds the proof for ``?challenge=`` to the response's headers."""
        values = parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("challenge")
        if not values or len(values[0]) > MAX_CHALLENGE_CHARS:
            return send
        answer = proof(self._secret, values[0]).encode()

        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER.lower().encode(), answer)]}
            await send(message)

        return sending
