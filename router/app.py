"""The router's HTTP server (aiohttp): the OpenAI API and ``/generate`` in front of the cluster,
plus the operator's endpoints.

    POST /generate, /v1/completions, /v1/chat/completions   forwarded to a prefill/decode pair
    GET  /v1/models                                          a healthy worker's list (cached)
    GET  /health (= /readiness)                              200 while a prefill and a decode are healthy
    GET  /liveness                                           200 while this process runs
    GET  /workers  POST /workers  DELETE /workers?url=U      list, add, drain-and-remove workers
    POST /flush_cache  POST /abort_request                   fanned out to every worker
    GET  /server_info /get_server_info /model_info /get_model_info   a healthy node's answer
    GET  /metrics                                            Prometheus

With ``--api-key`` every endpoint but /health, /readiness and /liveness needs it (router/auth.py);
with ``--cluster-secret`` every request to a node carries a request token made from it, and a
node is sent nothing before it proved the secret (router/node_auth.py). Request bodies are
read under ``--max-payload-size`` / ``--body-timeout-s`` and a JSON nesting bound
(common/aio_body.py); ``serve_options`` gives the server its header timeout. One ``aiohttp.ClientSession`` (one connection pool) carries every request to the workers, the
health probes and the load polls. Handlers are cancelled when their client disconnects, which
closes both legs of its request.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from common.aio_body import BodyError, BodyLimits, decode_json, read_body, read_json
from common.http_limits import INLINE_DECODE_BYTES, LISTEN_BACKLOG
from router import dashboard
from router.auth import CLIENT, require_keys
from router.clients import Clients, KeysFileError, retry_after, token_estimate
from router.config import ROLES, ConfigError, RouterConfig, WorkerSpec, check_bootstrap_port, check_url
from router.forward import USAGE, ForwardConfig, Forwarder, error_response
from router.kv_index import KVIndex
from router.kv_subscriber import KVSubscriptions
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.node_auth import sign_requests
from router.parse import RequestInfo, RouterError, inspect
from router.policies import ExactCacheAware, make_policy
from router.prompt_key import PromptTokenizer, RouteKey
from router.rooms import Rooms
from router.workers import Worker, Workers

MODELS_CACHE_S = 10.0
INLINE_TOKENIZE_BYTES = 8192  # larger bodies are tokenized in a worker thread, off the event loop


class Router:
    """Everything one router process holds; built in the app's start-up context."""

    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.session = session
        # Exact cache-aware routing needs the model's tokenizer; the nodes' KV events feed it: the
        # prefills' for the prefill pick, the decodes' (their prefix cache) for the decode pick.
        exact = tuple(role for role, name in (("prefill", cfg.prefill_policy), ("decode", cfg.decode_policy))
                      if cfg.tokenizer_path is not None and name == "cache-aware")
        if cfg.tokenizer_path is not None and not exact:
            logging.getLogger("router").warning("--tokenizer-path is used only by the cache-aware policies; "
                                                "the policies are %s (prefill) and %s (decode)",
                                                cfg.prefill_policy, cfg.decode_policy)
        if cfg.decode_local_prefill_tokens and "decode" not in exact:
            logging.getLogger("router").warning("--decode-local-prefill-tokens needs --decode-policy cache-aware "
                                                "and --tokenizer-path: no request will go to a decode alone")
        self.tokenizer = PromptTokenizer(cfg.tokenizer_path) if exact and cfg.tokenizer_path else None
        self.kv_index = KVIndex() if exact else None
        self.policies = {role: make_policy(name, cfg.cache, self.kv_index if role in exact else None, role)
                         for role, name in (("prefill", cfg.prefill_policy), ("decode", cfg.decode_policy))}
        self.workers = Workers(cfg.workers, cfg.health_failure_threshold, self._forget, cfg.cluster_secret)
        self.rooms = Rooms()
        self.metrics = RouterMetrics(self.workers.all)
        self.kv_subscriptions: KVSubscriptions | None = None
        if self.kv_index is not None:
            picks = {role: _counts(p) for role, p in self.policies.items() if isinstance(p, ExactCacheAware)}
            self.metrics.watch_kv(self.kv_index, picks)
            self.kv_subscriptions = KVSubscriptions(
                self.workers, self.kv_index, session, cfg.cluster_secret, cfg.kv_events_stale_s,
                lambda url, verdict: self.metrics.kv_events.labels(url, verdict).inc(), roles=exact)
        self.forwarder = Forwarder(self.workers, self.policies, self.rooms, session,
                                   ForwardConfig(cfg.request_timeout_s, cfg.max_retries, cfg.retry_budget_s,
                                                 cfg.decode_local_prefill_tokens),
                                   self.metrics)
        self.models: tuple[float, Any] | None = None  # (when fetched, body)
        self.body_limits = BodyLimits(cfg.max_payload_size, cfg.body_timeout_s)

    def _forget(self, url: str) -> None:
        for policy in self.policies.values():
            policy.forget(url)


def _counts(policy: ExactCacheAware) -> Callable[[], dict[str, int]]:
    return lambda: dict(policy.picks)


STATE = web.AppKey("router", Router)
CONFIG = web.AppKey("config", RouterConfig)
CLIENTS = web.AppKey("clients", Clients)
WORKER_SSL = web.AppKey("worker_ssl", object)  # ssl.SSLContext, or True: aiohttp's default checks


@web.middleware
async def _count_clients(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Every keyed request by its client's name and status (outside the key check, so refusals
    count too, as "-" when no key matched)."""
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        client = request.get(CLIENT)
        if STATE in request.app:
            request.app[STATE].metrics.client_requests.labels(client.name if client else "-", str(status)).inc()


def _reload_keys(app: web.Application) -> None:
    """SIGHUP: read the keys file again; a bad one keeps the keys in force."""
    try:
        app[CLIENTS].reload()
    except (KeysFileError, OSError) as exc:
        logging.getLogger("router").error("keys file not reloaded, the old keys stay in force: %s", exc)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    # No pool limit (the cluster's capacity is the limit); a connect is bounded so a dead host
    # fails a try in seconds. No total timeout here: each request has its own deadline. With a
    # cluster secret the session signs every request (forwards, fan-outs, load polls) in one place.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False,
                                                                   ssl=app[WORKER_SSL]),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                                    middlewares=(sign_requests(cfg.cluster_secret),) if cfg.cluster_secret else ())
    router = Router(cfg, session)
    app[STATE] = router
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no signals off the main thread
        loop.add_signal_handler(signal.SIGHUP, _reload_keys, app)
    loops = asyncio.create_task(router.workers.run(session, cfg.health_check_interval_s, cfg.load_poll_interval_s,
                                                   cfg.health_check_timeout_s))
    kv = asyncio.create_task(router.kv_subscriptions.run()) if router.kv_subscriptions is not None else None
    try:
        yield
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGHUP)
        # The probes finish rather than being cancelled mid-connect (see Workers.stop); a probe is
        # bounded by its timeout, so this wait is too.
        router.workers.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(loops), cfg.health_check_timeout_s + 1.0)
        for task in (loops, kv):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await session.close()


# ---- generation --------------------------------------------------------------------------------


def _decode_and_inspect(endpoint: str, raw: bytes, max_n: int, tokenizer: PromptTokenizer | None = None,
                        block_sizes: tuple[int, ...] = ()) -> tuple[Any, RequestInfo, RouteKey | None]:
    try:
        body = decode_json(raw)  # 400: too deep, not JSON
    except BodyError as exc:
        raise RouterError(exc.status, exc.message) from exc
    info = inspect(endpoint, body)
    n = info.sequences // (info.items or 1)
    if n > max_n:
        raise RouterError(400, f"'n' is {n}; this router allows at most {max_n} (--max-n)")
    return body, info, _route_key(tokenizer, endpoint, body, info, block_sizes)


def _route_key(tokenizer: PromptTokenizer | None, endpoint: str, body: dict, info: RequestInfo,
               block_sizes: tuple[int, ...] = ()) -> RouteKey | None:
    """The prompt as token ids for exact cache-aware routing, its block hashes for the workers'
    ``block_sizes`` computed here (in a worker thread for a large body, not in the policy on the
    event loop). A prompt the router cannot tokenize is routed by load (the nodes judge it), never
    refused here."""
    if tokenizer is None:
        return None
    try:
        tokens = tokenizer.prompt_ids(endpoint, body)
    except Exception:  # the tokenizer library's errors: a prediction is only an optimisation
        logging.getLogger("router").debug("could not tokenize a %s prompt", endpoint, exc_info=True)
        tokens = None
    key = RouteKey(info.key, tokens)
    if tokens is not None:
        for size in block_sizes:
            key.hashes(size)
    return key


def _generation(endpoint: str):  # type: ignore[no-untyped-def]
    async def handler(request: web.Request) -> web.StreamResponse:
        router = request.app[STATE]
        try:
            try:
                raw = await read_body(request, router.body_limits)  # 413, 408
            except BodyError as exc:
                raise RouterError(exc.status, exc.message) from exc
            # Decoding and inspecting 15 MB took the loop 0.6 s; tokenizing and hashing a prompt costs
            # more per byte, so with a tokenizer a smaller body already goes to a worker thread.
            sizes = router.kv_index.block_sizes() if router.kv_index is not None else ()
            if len(raw) > (INLINE_DECODE_BYTES if router.tokenizer is None else INLINE_TOKENIZE_BYTES):
                body, info, key = await asyncio.to_thread(_decode_and_inspect, endpoint, raw, router.cfg.max_n,
                                                          router.tokenizer, sizes)
            else:
                body, info, key = _decode_and_inspect(endpoint, raw, router.cfg.max_n, router.tokenizer, sizes)
        except RouterError as exc:
            router.metrics.requests.labels(endpoint, str(exc.status)).inc()
            router.metrics.errors.labels(endpoint, "bad_request").inc()
            return error_response(exc.status, exc.message)
        client = request.get(CLIENT)
        if client is None or client.tokens_per_min is None:
            return await router.forwarder.handle(request, endpoint, body, info, key)
        charged = token_estimate(body, len(raw), info.sequences)
        wait = request.app[CLIENTS].take(client, "tokens", charged)
        if wait > 0:
            router.metrics.requests.labels(endpoint, "429").inc()
            return error_response(429, f"{client.name!r} is over its limit of {client.tokens_per_min:g} tokens "
                                       "per minute (an estimate: prompt bytes / 4 + the most it may generate)",
                                  headers={"Retry-After": retry_after(wait)})
        resp = await router.forwarder.handle(request, endpoint, body, info, key)
        # Settled against what it cost: the usage the nodes reported; nothing for a request that
        # failed unanswered; the estimate where a stream ended without its usage.
        used = request.get(USAGE)
        if used is None and resp.status != 200:
            used = 0.0
        if used is not None:
            request.app[CLIENTS].settle(client, "tokens", charged, used)
        return resp

    return handler


# ---- health and workers ------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    router = request.app[STATE]
    counts = {role: len(router.workers.candidates(role)) for role in ROLES}
    missing = [role for role, n in counts.items() if n == 0]
    body = {"status": "ok" if not missing else "unavailable", "healthy_prefill": counts["prefill"],
            "healthy_decode": counts["decode"], "inflight_rooms": len(router.rooms)}
    if missing:
        body["message"] = f"no healthy {' and no healthy '.join(missing)} node"
    return web.json_response(body, status=200 if not missing else 503)


async def liveness(_: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def list_workers(request: web.Request) -> web.Response:
    return web.json_response({"workers": [w.as_dict() for w in request.app[STATE].workers.all()]})


async def add_worker(request: web.Request) -> web.Response:
    router = request.app[STATE]
    try:
        body = await read_json(request, router.body_limits)
    except BodyError as exc:
        return error_response(exc.status, exc.message)
    try:
        if not isinstance(body, dict):
            raise ConfigError("the body must be a JSON object")
        role = body.get("role")
        if role not in ROLES:
            raise ConfigError(f"'role' must be one of {list(ROLES)}, got {role!r}")
        url = check_url(str(body.get("url", "")), "url")
        port = check_bootstrap_port(body.get("bootstrap_port"), url) if role == "prefill" else None
        if role == "decode" and body.get("bootstrap_port") is not None:
            raise ConfigError("a decode node has no bootstrap port")
    except (ValueError, ConfigError) as exc:
        return error_response(400, str(exc))
    if not router.cfg.worker_allowed(url):
        # Checked before anything contacts the URL: an operator key that leaks still cannot point
        # the router at a host outside the allowlist.
        return error_response(403, f"{url} is outside --worker-allow {list(router.cfg.worker_allow)}: not added, "
                                   "not contacted")
    try:
        w = router.workers.add(WorkerSpec(url, role, port))
    except ValueError as exc:
        return error_response(409, str(exc))
    return web.json_response({"added": w.as_dict()})


async def remove_worker(request: web.Request) -> web.Response:
    url = request.query.get("url", "").rstrip("/")
    try:
        w = request.app[STATE].workers.remove(url)
    except KeyError:
        return error_response(404, f"no worker {url!r} (or it is already draining)")
    return web.json_response({"removed": w.url, "draining_requests": w.inflight})


# ---- fan-out and pass-through ---------------------------------------------------------------------


async def _call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    try:
        async with session.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode(errors="replace")[:500]
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


async def fan_out(request: web.Request, path: str, body: Any = None) -> web.Response:
    router = request.app[STATE]
    workers = router.workers.all()

    async def call(w: Worker) -> tuple[int, Any]:
        # With a secret, a worker that has not proven it (not healthy) is sent nothing.
        if router.cfg.cluster_secret and not w.healthy:
            return 0, f"not sent: the worker is not healthy ({w.last_error or 'not probed yet'})"
        return await _call(router.session, "POST", w.url + path, body)

    results = await asyncio.gather(*(call(w) for w in workers))
    per = {w.url: {"role": w.role, "status": s, "body": b} for w, (s, b) in zip(workers, results)}
    ok = all(r["status"] == 200 for r in per.values())
    return web.json_response({"success": ok, "workers": per}, status=200 if ok else 502)


async def flush_cache(request: web.Request) -> web.Response:
    return await fan_out(request, "/flush_cache")


async def abort_request(request: web.Request) -> web.Response:
    try:
        body = await read_json(request, request.app[STATE].body_limits)
    except BodyError as exc:
        return error_response(exc.status, exc.message)
    # The nodes' own rule, checked here: a body every node would refuse is the client's error
    # (400), not a failure of the workers (502). Found by tests/e2e/test_fuzz_http.py.
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)) or (rid is None and not abort_all):
        return error_response(400, 'expected {"rid": string} or {"abort_all": true}')
    return await fan_out(request, "/abort_request", body)


def _from_a_node(path: str):  # type: ignore[no-untyped-def]
    """GET ``path`` from a healthy decode (else prefill) node and answer with its body."""

    async def handler(request: web.Request) -> web.Response:
        router = request.app[STATE]
        for w in router.workers.candidates("decode") + router.workers.candidates("prefill"):
            status, body = await _call(router.session, "GET", w.url + path)
            if status == 200:
                return web.json_response(body)
        return error_response(503, f"no healthy node answered {path}")

    return handler


async def models(request: web.Request) -> web.Response:
    router = request.app[STATE]
    if router.models is not None and time.monotonic() - router.models[0] < MODELS_CACHE_S:
        return web.json_response(router.models[1])
    resp = await _from_a_node("/v1/models")(request)
    if resp.status == 200:
        router.models = (time.monotonic(), json.loads(resp.body))  # type: ignore[arg-type]
    return resp


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def serve_options(cfg: RouterConfig) -> dict[str, Any]:
    """The server's (not the app's) options: aiohttp closes a connection whose request head has
    not arrived ``keepalive_timeout`` after it opened or after its last response, so that is the
    header timeout (slowloris; an idle keep-alive connection goes as soon). The listen backlog
    is uvicorn's, not aiohttp's 128 (common/http_limits.py). With a certificate, the TLS context
    clients reach the router through."""
    options: dict[str, Any] = {"keepalive_timeout": cfg.header_timeout_s, "backlog": LISTEN_BACKLOG}
    if cfg.ssl_certfile is not None:
        options["ssl_context"] = server_ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile)
    return options


def server_ssl_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """TLS 1.2+ with Python's default ciphers for the router's listener (``ConfigError`` naming
    the flag when the files do not load)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load: {exc}") from exc
    return ctx


def worker_ssl_context(cfg: RouterConfig) -> ssl.SSLContext | bool:
    """What the router's one session checks https:// workers with: certificates against
    ``--worker-ssl-ca-certs`` (else the system's CAs), showing ``--worker-ssl-certfile`` to nodes
    that require a client certificate. True (aiohttp's default checks) when neither is set."""
    if cfg.worker_ssl_ca_certs is None and cfg.worker_ssl_certfile is None:
        return True
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.worker_ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--worker-ssl-ca-certs {cfg.worker_ssl_ca_certs}: cannot load: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.worker_ssl_certfile is not None:
        try:
            ctx.load_cert_chain(cfg.worker_ssl_certfile, cfg.worker_ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--worker-ssl-certfile {cfg.worker_ssl_certfile} / --worker-ssl-keyfile "
                              f"{cfg.worker_ssl_keyfile}: cannot load: {exc}") from exc
    return ctx


def create_app(cfg: RouterConfig) -> web.Application:
    clients = Clients(cfg.api_key, cfg.operator_key, cfg.keys_file)
    middlewares = [_count_clients, require_keys(clients)] if clients.enabled else []
    # client_max_size: aiohttp's own stop for a chunked body; read_json refuses a declared length first.
    app = web.Application(client_max_size=cfg.max_payload_size, middlewares=middlewares)
    app[CONFIG] = cfg
    app[CLIENTS] = clients
    app[WORKER_SSL] = worker_ssl_context(cfg)  # a file that does not load: ConfigError, exit 2
    app.cleanup_ctx.append(_lifecycle)
    r = app.router
    r.add_post("/generate", _generation("generate"))
    r.add_post("/v1/completions", _generation("completions"))
    r.add_post("/v1/chat/completions", _generation("chat"))
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/readiness", health)
    r.add_get("/liveness", liveness)
    r.add_get("/workers", list_workers)
    r.add_post("/workers", add_worker)
    r.add_delete("/workers", remove_worker)
    r.add_post("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        r.add_get(path, _from_a_node(path))
    r.add_get("/metrics", metrics)
    dashboard.add_routes(app, STATE)  # GET /dashboard (the live page) and /dashboard/data
    return app
