"""FastAPI app factory shared by the prefill and decode nodes (DESIGN §5.1, the worker HTTP API).

Generation endpoints parse and validate here (400 before anything reaches the scheduler), then
hand over to ``generation.serve``. Ops endpoints answer from config or from a scheduler query.
With ``cfg.cluster_secret`` every route but /health needs it (common/server/auth.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.request import SamplingParams
from common.server.auth import RequireClusterSecret
from common.server.config import ApiConfig
from common.server.errors import ApiError, bad_request, error_response
from common.server.generation import Inflight, serve, wait_finished
from common.server.metrics import ApiMetrics
from common.server.parse_common import ParsedRequest, SubRequest
from common.server.parse_native import parse_generate
from common.server.parse_openai import parse_chat, parse_completion
from common.server.scheduler_client import DuplicateRid, SchedulerClient, SchedulerGone
from common.server.textio import TokenizerLike

logger = logging.getLogger(__name__)

# Bodies above this are tokenized in a worker thread so one huge batch does not stall every stream.
_INLINE_PARSE_BYTES = 16 * 1024
VERSION = "0.1.0"

Parser = Callable[[Any, ApiConfig, TokenizerLike], ParsedRequest]


# A \uD800-\uDFFF escape: only through one can json.loads (of strictly decoded text) produce a
# lone surrogate, which no tokenizer or msgpack encoder downstream accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def _read_json(request: Request) -> tuple[Any, int]:
    raw = await request.body()
    try:
        # Strict UTF-8 (RFC 8259); json.loads(bytes) would let encoded surrogates through.
        text = raw.decode("utf-8-sig")
        body = json.loads(text)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(text):  # rare: then check every string (pairs are fine)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
            raise bad_request(f"the body contains an unpaired UTF-16 surrogate ({bad})") from exc
    return body, len(raw)


def create_app(cfg: ApiConfig, scheduler: SchedulerClient, tokenizer: TokenizerLike) -> FastAPI:
    cfg.validate()
    metrics = ApiMetrics(cfg.role, cfg.model_name)
    registry: dict[str, Inflight] = {}
    started = time.time()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.close()

    app = FastAPI(title="pdcluster node", version=VERSION, lifespan=lifespan)
    app.state.cfg, app.state.scheduler, app.state.tokenizer, app.state.metrics = cfg, scheduler, tokenizer, metrics
    if cfg.cluster_secret is not None:
        app.add_middleware(RequireClusterSecret, secret=cfg.cluster_secret)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the API process")
        return error_response(500, f"internal error in the API process: {type(exc).__name__}: {exc}")

    async def generation(request: Request, parser: Parser, endpoint: str) -> Response:
        body, size = await _read_json(request)
        if size > _INLINE_PARSE_BYTES:
            parsed = await asyncio.to_thread(parser, body, cfg, tokenizer)
        else:
            parsed = parser(body, cfg, tokenizer)
        return await serve(request, parsed, scheduler, tokenizer, metrics, cfg.role, endpoint, registry)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await generation(request, parse_generate, "generate")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, parse_completion, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, parse_chat, "chat_completions")

    # ---- health ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if scheduler.gone_reason is not None:
            return error_response(503, f"the scheduler is unavailable: {scheduler.gone_reason}")
        if not scheduler.ready.is_set():
            return error_response(503, "the scheduler has not answered yet (starting)")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Generate one token locally (no bootstrap room): proves the scheduler loop turns."""
        ids = tokenizer.encode("ping", add_special_tokens=False)[:1] or [0]
        sub = SubRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", index=0, input_ids=ids,
                         sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        req = ParsedRequest(kind="generate", rid=sub.rid, subs=[sub], stream=False, model=cfg.model_name)
        inflight = Inflight(scheduler, req, tokenizer, metrics, abort_on_close=True, endpoint="health_generate",
                            registry=registry)
        try:
            inflight.start(None)
        except (DuplicateRid, SchedulerGone) as exc:
            return error_response(503, f"health check failed: {exc}")
        try:
            ok = await wait_finished(inflight, cfg.health_generate_timeout_s)
        finally:
            inflight.close()
        s = inflight.states[0]
        # A 4xx answer (e.g. "this node only takes disaggregated requests") still proves liveness.
        if ok and (s.http_status is None or s.http_status < 500):
            return Response(status_code=200)
        reason = s.error if ok else f"no answer within {cfg.health_generate_timeout_s:g} s"
        return error_response(503, f"health check failed: {reason}")

    # ---- info -----------------------------------------------------------------------------------

    def server_info() -> dict:
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "served_model_name": cfg.model_name,
            "is_generation": True,
            "dp_size": 1,
            "tp_size": 1,
            "disaggregation_mode": cfg.role,
            "disaggregation_bootstrap_port": cfg.bootstrap_port,
            "context_length": cfg.context_length,
            "max_req_input_len": cfg.context_length - 1,
            "host": cfg.host,
            "port": cfg.port,
            "version": VERSION,
            "uptime_s": round(time.time() - started, 3),
            **cfg.server_info_extra,
        }

    def model_info() -> dict:
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "is_generation": True,
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures),
            "served_model_name": cfg.model_name,
        }

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": int(started), "owned_by": "pdcluster",
            "root": cfg.model_path, "max_model_len": cfg.context_length,
        }]}

    # ---- scheduler queries ----------------------------------------------------------------------

    async def ask(what: str) -> dict:
        try:
            return await scheduler.query(what, cfg.query_timeout_s)
        except TimeoutError as exc:
            raise ApiError(503, f"the scheduler did not answer the {what} query within "
                                f"{cfg.query_timeout_s:g} s") from exc
        except SchedulerGone as exc:
            raise ApiError(503, f"the scheduler is unavailable: {exc}") from exc

    @app.get("/get_load")
    async def get_load() -> list:
        return [{"dp_rank": 0, **(await ask("load"))}]

    @app.get("/debug/memory")
    async def debug_memory() -> dict:
        return await ask("memory")

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            payload: dict | None = await scheduler.query("metrics", cfg.query_timeout_s)
        except (TimeoutError, SchedulerGone):
            payload = None
        return Response(metrics.render(payload), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            reply = await scheduler.flush_cache(cfg.query_timeout_s)
        except TimeoutError:
            return error_response(503, f"the scheduler did not answer flush_cache within {cfg.query_timeout_s:g} s")
        except SchedulerGone as exc:
            return error_response(503, f"the scheduler is unavailable: {exc}")
        ok = bool(reply.get("success"))
        return JSONResponse({"success": ok, "message": str(reply.get("message", ""))}, status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        body, _ = await _read_json(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
            raise bad_request("expected {\"rid\": string} or {\"abort_all\": true}")
        aborted: list[str] = []
        if abort_all:
            for inflight in list(registry.values()):
                aborted += inflight.abort_all()
        elif rid in registry:
            aborted = registry[rid].abort_all()
        elif rid is not None and scheduler.is_inflight(rid):  # one sequence of a batch or n > 1
            scheduler.abort(rid)
            aborted = [rid]
        elif rid is None:
            raise bad_request("give 'rid' or 'abort_all': true")
        return {"aborted": aborted}

    return app
