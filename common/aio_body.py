"""Reading a request body under limits, for the aiohttp servers (the router and the bootstrap
registry)::

    Content-Length over the limit  -> 413 before a byte of the body is read
    a chunked body over the limit  -> 413 once the limit is passed (aiohttp's client_max_size)
    the body not in within timeout -> 408
    nesting deeper than the limit  -> 400, before any decoder recurses (common.http_limits)
    not JSON                       -> 400

A large body is decoded in a worker thread so the event loop keeps serving /health meanwhile.
A slow head (slowloris) is the server's business, not a handler's: aiohttp closes a
connection whose request head has not arrived within its ``keepalive_timeout``, counted from the
connection's start and from each response, so the servers set it to their header timeout.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common.http_limits import INLINE_DECODE_BYTES, MAX_JSON_DEPTH, json_too_deep


class BodyError(Exception):
    """A body refused under a limit; ``status`` is the HTTP answer (400, 408, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float  # the whole body, from the handler's start
    max_depth: int = MAX_JSON_DEPTH


def too_large(limit: int) -> BodyError:
    return BodyError(413, f"the request body is larger than this server's limit of {limit} bytes")


async def read_body(request: web.Request, limits: BodyLimits) -> bytes:
    """The raw body, or ``BodyError`` (413 / 408). The application's ``client_max_size`` must be
    at least ``limits.max_bytes``: aiohttp enforces it on a chunked body as it reads."""
    length = request.content_length
    if length is not None and length > limits.max_bytes:
        raise too_large(limits.max_bytes)  # aiohttp discards the unread rest, bounded in time
    try:
        async with asyncio.timeout(limits.timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {limits.timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limits.max_bytes) from None
    if len(raw) > limits.max_bytes:  # client_max_size set larger than the limit
        raise too_large(limits.max_bytes)
    return raw


def decode_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` as JSON (strict UTF-8), or ``BodyError(400)``: too deep, or not JSON."""
    reason = json_too_deep(raw, max_depth)
    if reason is not None:
        raise BodyError(400, reason)
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BodyError(400, f"the body is not valid JSON: {exc}") from exc


async def read_json(request: web.Request, limits: BodyLimits) -> Any:
    """The decoded body under ``limits``; a large one is checked and decoded in a worker thread."""
    raw = await read_body(request, limits)
    if len(raw) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(decode_json, raw, limits.max_depth)
    return decode_json(raw, limits.max_depth)
