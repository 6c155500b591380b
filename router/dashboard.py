"""The live cluster page: ``GET /dashboard`` (one static HTML file with a small script: no build
step, nothing loaded from outside the router) and ``GET /dashboard/data``, the JSON it polls.

    browser --every refresh_s--> GET /dashboard/data --> ClusterView.snapshot()
        at most one gather per MIN_INTERVAL_S, however many pages are open (they share it):
        the router's own view of each worker: role, health, draining, load, in-flight, routed,
            recent TTFT/TPOT of its streams (router/metrics.py RecentLatency)
        + from each worker, all at once, each call bounded by FETCH_TIMEOUT_S:
            GET /debug/memory   queue lengths, KV pages, transfer rooms
            GET /metrics        pdc_scheduler_gen_throughput (tokens/s), pdc_scheduler_up
        a worker that does not answer is listed with why, never fails the page

Registered by ``add_routes(app, state_key)`` so router/app.py only calls it; the router process
it runs in imports no torch.
"""
from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import time
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.config import ROLES
from router.metrics import RecentLatency
from router.workers import Worker, Workers

log = logging.getLogger("router.dashboard")

FETCH_TIMEOUT_S = 1.5  # per worker call: a hung node costs the page this much, not a hang
MIN_INTERVAL_S = 1.0  # gathers are shared below this age, so open pages do not multiply node load
REFRESH_S = 2.0  # the page's default poll period (``?refresh=S`` overrides it)
PAGE = "static/dashboard.html"
# The page may talk only to its own origin, and runs only its own inline script and style.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'")

# (label on the page, key in the node's /debug/memory), in the order a request passes them.
QUEUES = {
    "prefill": (("bootstrap", "bootstrap_reqs"), ("waiting", "waiting_reqs"), ("chunked", "chunked_reqs"),
                ("parked", "parked_reqs"), ("transferring", "inflight_reqs")),
    "decode": (("prealloc", "num_prealloc"), ("transfer", "num_transfer"), ("waiting", "num_waiting"),
               ("running", "num_running"), ("retracted", "num_retracted"), ("draining", "num_draining")),
}
# The queue whose requests have KV on the wire (prefill: being sent; decode: being received).
TRANSFER_QUEUE = {"prefill": "inflight_reqs", "decode": "num_transfer"}
RUNNING = {"prefill": ("inflight_reqs", "chunked_reqs", "parked_reqs"), "decode": ("num_running",)}


class RouterLike(Protocol):
    """What the page reads from the router (router.app.Router)."""

    session: aiohttp.ClientSession
    workers: Workers
    rooms: Any  # len() = rooms in flight


class ClusterView:
    """Gathers the page's numbers; one shared gather at a time."""

    def __init__(self, recent: RecentLatency) -> None:
        self._recent = recent
        self._lock = asyncio.Lock()
        self._last: tuple[float, dict] | None = None  # (monotonic time, snapshot)

    async def snapshot(self, router: RouterLike) -> dict:
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < MIN_INTERVAL_S:
                return self._last[1]
            snap = await self._gather(router)
            self._last = (time.monotonic(), snap)
            return snap

    async def _gather(self, router: RouterLike) -> dict:
        workers = router.workers.all()
        # With a cluster secret, a worker that has not proven it (not healthy) is sent nothing.
        guarded = router.cfg.cluster_secret is not None
        fetched = await asyncio.gather(*(self._fetch(router.session, w) if w.healthy or not guarded
                                         else _not_sent(w) for w in workers))
        counts = {role: len(router.workers.candidates(role)) for role in ROLES}
        return {
            "generated_at": time.time(),
            "window_s": self._recent.window_s,
            "refresh_s": REFRESH_S,
            "cluster": {"status": "ok" if all(counts.values()) else "unavailable",
                        "healthy_prefill": counts["prefill"], "healthy_decode": counts["decode"],
                        "inflight_rooms": len(router.rooms)},
            "workers": [self._row(w, mem, met, err) for w, (mem, met, err) in zip(workers, fetched)],
        }

    async def _fetch(self, session: aiohttp.ClientSession, w: Worker) -> tuple[dict | None, dict | None, str | None]:
        """(``/debug/memory`` body, scheduler gauges from ``/metrics``, the first error) for one worker."""
        mem_res, met_res = await asyncio.gather(_get(session, w.url + "/debug/memory", json_body=True),
                                                _get(session, w.url + "/metrics", json_body=False))
        mem, mem_err = mem_res
        text, met_err = met_res
        gauges = None
        if isinstance(text, str):
            try:
                gauges = scheduler_gauges(text)
            except ValueError as exc:
                met_err = f"/metrics: unreadable exposition text: {exc}"
        if not isinstance(mem, dict) and mem_err is None:
            mem_err = "/debug/memory: not a JSON object"
        return (mem if isinstance(mem, dict) else None), gauges, mem_err or met_err

    def _row(self, w: Worker, mem: dict | None, gauges: dict | None, error: str | None) -> dict:
        row: dict[str, Any] = {**w.as_dict(), "reachable": mem is not None, "error": error,
                               "ttft": self._recent.summary(w.url, "ttft"), "tpot": self._recent.summary(w.url, "tpot"),
                               "queues": None, "running": None, "transfers": None, "transfer_rooms": None, "kv": None,
                               "throughput": None, "scheduler_up": None}
        if mem is not None:
            role = w.role if w.role in QUEUES else "decode"
            row["queues"] = [[label, _int(mem.get(key))] for label, key in QUEUES[role]]
            row["running"] = sum(_int(mem.get(k)) for k in RUNNING[role])
            row["transfers"] = _int(mem.get(TRANSFER_QUEUE[role]))
            row["transfer_rooms"] = _int(mem.get("transfer_rooms"))
            total, free = _int(mem.get("total_pages")), _int(mem.get("free_pages"))
            row["kv"] = {"page_size": _int(mem.get("page_size")), "total_pages": total, "free_pages": free,
                         "used_pages": _int(mem.get("used_pages")), "cached_pages": _int(mem.get("cached_pages")),
                         "usage": (total - free) / total if total > 0 else None,
                         "integrity": mem.get("integrity")}
        if gauges is not None:
            row["scheduler_up"] = gauges.get("up") == 1.0
            row["throughput"] = gauges.get("gen_throughput")
        return row


async def _get(session: aiohttp.ClientSession, url: str, json_body: bool) -> tuple[Any, str | None]:
    """(body, None) or (None, why not), within FETCH_TIMEOUT_S; never raises for a bad node."""
    path = url[url.index("/", url.index("//") + 2):]
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as r:
            raw = await r.read()
            if r.status != 200:
                return None, f"{path} answered {r.status}: {raw.decode(errors='replace')[:200]}"
            text = raw.decode(errors="replace")
            return (json.loads(text) if json_body else text), None
    except TimeoutError:
        return None, f"{path}: no answer within {FETCH_TIMEOUT_S:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        return None, f"{path}: {type(exc).__name__}: {exc}"
    except ValueError as exc:
        return None, f"{path}: not JSON: {exc}"


async def _not_sent(w: Worker) -> tuple[None, None, str]:
    return None, None, f"not asked: the worker is not healthy ({w.last_error or 'not probed yet'})"


def scheduler_gauges(text: str) -> dict[str, float]:
    """``{name: value}`` of the ``pdc_scheduler_*`` samples in a node's /metrics, prefix dropped
    (a node has one scheduler, so one sample per name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pdc_scheduler_"):
                out[sample.name.removeprefix("pdc_scheduler_")] = float(sample.value)
    return out


def _int(v: object) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _page() -> bytes:
    return importlib.resources.files("router").joinpath(PAGE).read_bytes()


VIEW = web.AppKey("dashboard", ClusterView)


def add_routes(app: web.Application, state_key: web.AppKey) -> None:
    """``GET /dashboard`` and ``GET /dashboard/data`` on ``app``, whose ``app[state_key]`` (the
    Router, with its RecentLatency at ``.metrics.recent``) exists once the app has started."""
    page: list[bytes] = []  # read on first use, then kept

    async def start(app: web.Application) -> None:  # runs after the cleanup contexts made the Router
        app[VIEW] = ClusterView(app[state_key].metrics.recent)

    async def dashboard(_: web.Request) -> web.Response:
        if not page:
            try:
                page.append(_page())
            except OSError as exc:  # a packaging fault: say which, rather than a bare 500
                log.error("the dashboard page is missing from the installed package: %s", exc)
                return web.json_response({"error": {"message": f"dashboard page missing: {exc}", "code": 500}},
                                         status=500)
        return web.Response(body=page[0], content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})

    async def data(request: web.Request) -> web.Response:
        snap = await request.app[VIEW].snapshot(request.app[state_key])
        return web.json_response(snap, headers={"Cache-Control": "no-store"})

    app.on_startup.append(start)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/data", data)
