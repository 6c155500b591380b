"""``POST /generate`` (SGLang's native API) and the parse-then-serve step every generation
route shares (the OpenAI routes in ``routes_openai`` use it too)::

    body (size and time: the BodyLimit middleware) -> strict JSON, nesting bounded -> parser: 400
    before anything reaches the scheduler -> generation.serve

A large body is decoded and parsed (tokenized) in a worker thread, so /health keeps answering.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.http_limits import INLINE_DECODE_BYTES, trim_heap
from common.server.config import ApiConfig
from common.server.context import AppContext, decode_json
from common.server.generation import serve
from common.server.parse_common import ParsedRequest
from common.server.parse_native import parse_generate
from common.server.textio import TokenizerLike

# Bodies above this are tokenized in a worker thread so one huge batch does not stall every stream.
_INLINE_PARSE_BYTES = 16 * 1024

Parser = Callable[[Any, ApiConfig, TokenizerLike], ParsedRequest]


def _decode_and_parse(raw: bytes, parser: Parser, cfg: ApiConfig, tok: TokenizerLike) -> ParsedRequest:
    """The worker thread's part for a large body: decode, parse, tokenize; then hand the heap's
    freed pages back (the tokenizer's buffers of a long prompt stayed as RSS, refused or not)."""
    try:
        return parser(decode_json(raw), cfg, tok)
    finally:
        if len(raw) > INLINE_DECODE_BYTES:
            trim_heap()


async def parse_and_serve(ctx: AppContext, request: Request, parser: Parser, endpoint: str) -> Response:
    raw = await request.body()  # under the BodyLimit middleware's size and time limits
    if len(raw) > _INLINE_PARSE_BYTES:
        parsed = await asyncio.to_thread(_decode_and_parse, raw, parser, ctx.cfg, ctx.tokenizer)
    else:
        parsed = parser(decode_json(raw), ctx.cfg, ctx.tokenizer)
    return await serve(request, parsed, ctx.scheduler, ctx.tokenizer, ctx.metrics, ctx.cfg.role, endpoint,
                       ctx.registry)


def register(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await parse_and_serve(ctx, request, parse_generate, "generate")
