"""``POST /generate`` (SGLang's native API) and the parse-then-serve step every generation
route shares (the OpenAI routes in ``routes_openai`` use it too)::

    body (strict JSON) -> parser: 400 before anything reaches the scheduler -> generation.serve
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.server.config import ApiConfig
from common.server.context import AppContext, read_json
from common.server.generation import serve
from common.server.parse_common import ParsedRequest
from common.server.parse_native import parse_generate
from common.server.textio import TokenizerLike

# Bodies above this are tokenized in a worker thread so one huge batch does not stall every stream.
_INLINE_PARSE_BYTES = 16 * 1024

Parser = Callable[[Any, ApiConfig, TokenizerLike], ParsedRequest]


async def parse_and_serve(ctx: AppContext, request: Request, parser: Parser, endpoint: str) -> Response:
    body, size = await read_json(request)
    if size > _INLINE_PARSE_BYTES:
        parsed = await asyncio.to_thread(parser, body, ctx.cfg, ctx.tokenizer)
    else:
        parsed = parser(body, ctx.cfg, ctx.tokenizer)
    return await serve(request, parsed, ctx.scheduler, ctx.tokenizer, ctx.metrics, ctx.cfg.role, endpoint,
                       ctx.registry)


def register(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await parse_and_serve(ctx, request, parse_generate, "generate")
