"""Scheduler queries and control: ``GET /get_load``, ``/debug/memory``, ``/metrics``,
``/kv_events/snapshot``; ``GET|POST /flush_cache``; ``POST /abort_request``.

Queries wait at most ``cfg.query_timeout_s`` for the scheduler; a scheduler that does not answer
(or is gone) is a 503, except on ``/metrics``, which then renders the API process's own series and
``pdc_scheduler_up 0``.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.server.context import AppContext, read_json
from common.server.errors import ApiError, bad_request, error_response
from common.ipc.scheduler_client import SchedulerGone


def register(app: FastAPI, ctx: AppContext) -> None:
    cfg, scheduler, registry = ctx.cfg, ctx.scheduler, ctx.registry

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

    @app.get("/kv_events/snapshot")
    async def kv_snapshot() -> Response:
        """The prefix cache's blocks and the KV-event seq they include (docs/PROTOCOL.md §7): a
        subscriber's starting point. Answered between two scheduler steps, so it is exact."""
        snap = await ask("kv_snapshot")
        if "error" in snap:
            return error_response(404, str(snap["error"]))
        return JSONResponse(snap)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            payload: dict | None = await scheduler.query("metrics", cfg.query_timeout_s)
        except (TimeoutError, SchedulerGone):
            payload = None
        return Response(ctx.metrics.render(payload), media_type="text/plain; version=0.0.4; charset=utf-8")

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
        body, _ = await read_json(request)
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
