"""Client input limits of a node's API process, below the routes (the values: ``ApiConfig``)::

    BodyLimit          ASGI middleware: a declared Content-Length over the limit is a 413 before
                       a byte of the body is read; a chunked body is a 413 once it passes the
                       limit; a body not in within the body timeout is a 408. Either way the
                       connection closes after the answer (the rest of the body is never read).
    head_timeout_protocol(base, s)
                       uvicorn's HTTP protocol plus a header timeout, which uvicorn lacks: a
                       connection whose request head has not arrived ``s`` seconds after it
                       opened (or after that request's first byte, on a kept-alive connection)
                       is closed. Idle keep-alive stays uvicorn's ``timeout_keep_alive``.

The JSON nesting bound and the worker-thread decoding are the body reader's
(``common.server.context.read_json``); the ``n`` cap is the parsers'.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from common.server.errors import ApiError, error_body

Scope = dict[str, Any]
Message = dict[str, Any]


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes"


class BodyLimit:
    """Pure ASGI middleware (a ``BaseHTTPMiddleware`` would read the body itself)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await _send_error(send, 413, _too_large(self.max_bytes))
            return
        refused = False
        received = 0
        body_done = scope.get("method") in ("GET", "HEAD")
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def limited_receive() -> Message:
            nonlocal refused, received, body_done
            if body_done:  # the body is in: what follows is the disconnect watch, unbounded
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused = True
                raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    raise ApiError(413, _too_large(self.max_bytes))
                body_done = not message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            if refused and message["type"] == "http.response.start":
                # The unread rest of the body must not be parsed as the next request.
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, closing_send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser has refused it already
    return None


async def _send_error(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def head_timeout_protocol(base: type, timeout_s: float) -> type:
    """``base`` (uvicorn's httptools or h11 protocol class) with a header timeout.

    Both implementations create a new ``cycle`` once a request's head is parsed, inside
    ``data_received``; that is the one hook they share, so the timer is armed when a connection
    opens or when bytes arrive while no request is in progress, and disarmed when a new cycle
    appears.
    """

    class HeadTimeout(base):  # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None
        _seen_cycle: object = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = getattr(self, "cycle", None)
            if self._head_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle is not self._seen_cycle:
                self._seen_cycle = cycle  # a new request's head is complete
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = asyncio.get_running_loop().call_later(timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    HeadTimeout.__name__ = HeadTimeout.__qualname__ = f"HeadTimeout{base.__name__}"
    return HeadTimeout
