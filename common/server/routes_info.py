"""Is this node up, and what does it serve: ``GET /health``, ``/health_generate``,
``/server_info`` and ``/model_info`` (each also under SGLang's older ``/get_…`` name).

``/health`` is the one route that needs no cluster secret (common/server/auth.py): probes carry none.
"""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI
from fastapi.responses import Response

from common.request import SamplingParams
from common.server.context import VERSION, AppContext
from common.server.errors import error_response
from common.server.generation import Inflight, wait_finished
from common.server.parse_common import ParsedRequest, SubRequest
from common.ipc.scheduler_client import DuplicateRid, SchedulerGone


def register(app: FastAPI, ctx: AppContext) -> None:
    cfg, scheduler = ctx.cfg, ctx.scheduler

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
        ids = ctx.tokenizer.encode("ping", add_special_tokens=False)[:1] or [0]
        sub = SubRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", index=0, input_ids=ids,
                         sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        req = ParsedRequest(kind="generate", rid=sub.rid, subs=[sub], stream=False, model=cfg.model_name)
        inflight = Inflight(scheduler, req, ctx.tokenizer, ctx.metrics, abort_on_close=True,
                            endpoint="health_generate", registry=ctx.registry)
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
            "uptime_s": round(time.time() - ctx.started, 3),
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
