"""The OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /v1/models``. Parsing (and the features refused with a 400) is ``parse_openai``'s; serving
is the one path every generation route takes (``routes_generate.parse_and_serve``).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from common.server.context import AppContext
from common.server.parse_openai import parse_chat, parse_completion
from common.server.routes_generate import parse_and_serve


def register(app: FastAPI, ctx: AppContext) -> None:
    cfg = ctx.cfg

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await parse_and_serve(ctx, request, parse_completion, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await parse_and_serve(ctx, request, parse_chat, "chat_completions")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": int(ctx.started), "owned_by": "pdcluster",
            "root": cfg.model_path, "max_model_len": cfg.context_length,
        }]}
