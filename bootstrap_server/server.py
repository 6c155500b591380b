"""aiohttp shell over the ``Registry``: the HTTP API, an in-loop server and a threaded one.

Routes (JSON bodies; every error is ``{"error": "<reason>"}``)::

    PUT    /route                                  body RankInfo          200 | 400
    GET    /route?engine_rank=R&target_dp_group=G[&target_pp_rank=P]       200 RankInfo | 400 | 404
    GET    /route?engine_rank=-1&target_dp_group=-1                        200 PrefillLayout | 404
    DELETE /route?engine_rank=R&target_dp_group=G[&target_pp_rank=P][&instance_id=I]
                                                                           200 | 400 | 404 | 409
    DELETE /route?engine_rank=-1&target_dp_group=-1                        200 (removes every rank)
    GET    /routes                                 every registered RankInfo (for operators)
    GET    /health                                 200 "OK" | 503 (the embedder's health check said no)

A body is refused before it is read when it is larger than 64 KiB (413), too slow (408) or nested
deeper than common/http_limits.py allows (400); a request head slower than the header timeout
closes its connection. With a cluster secret every route but ``GET /health`` needs a request token made from it
and answers 401 without it: registering or removing a rank redirects decodes' KV writes, and the
routes name every rank's control and data-plane address.

404 on ``GET /route`` is "not registered yet": the decode retries it for a bounded time.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from bootstrap_server.client import bootstrap_url
from common.aio_body import BodyError, BodyLimits, read_body
from common.auth import CHALLENGE_HEADER, MAX_CHALLENGE_CHARS, PROOF_HEADER, WWW_AUTHENTICATE, RefusalLog, RequestVerifier, proof
from common.http_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, LISTEN_BACKLOG, REGISTRY_MAX_BODY_BYTES, json_too_deep
from bootstrap_server.registry import Registry, RegistryConflict, format_key
from bootstrap_server.schema import RankInfo

logger = logging.getLogger(__name__)

HealthCheck = Callable[[], bool]
REGISTRY_KEY = web.AppKey("registry", Registry)
HEALTH_KEY: web.AppKey[HealthCheck] = web.AppKey("health_check")
LIMITS_KEY = web.AppKey("body_limits", BodyLimits)
# A RankInfo is a few hundred bytes: a larger body is a 413 before it is read.
DEFAULT_LIMITS = BodyLimits(REGISTRY_MAX_BODY_BYTES, BODY_TIMEOUT_S)
_MAX_INDEX = 65535
_json = msgspec.json.Encoder()


class _BadQuery(ValueError):
    pass


def _reply(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(obj), content_type="application/json")


def _error(status: int, reason: str) -> web.Response:
    return _reply({"error": reason}, status=status)


def _query(request: web.Request, optional: tuple[str, ...]) -> tuple[int, int, int | None, dict[str, str]]:
    """Parse ``engine_rank``, ``target_dp_group``, optional ``target_pp_rank`` and the ``optional`` strings."""
    allowed = {"engine_rank", "target_dp_group", "target_pp_rank", *optional}
    for name in request.query:
        if name not in allowed:
            raise _BadQuery(f"unknown query parameter {name!r}; expected {', '.join(sorted(allowed))}")

    def one(name: str, required: bool) -> str | None:
        values = request.query.getall(name, [])
        if len(values) > 1:
            raise _BadQuery(f"query parameter {name!r} given {len(values)} times")
        if not values and required:
            raise _BadQuery(f"missing query parameter {name!r}")
        return values[0] if values else None

    def integer(name: str, required: bool) -> int | None:
        raw = one(name, required)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise _BadQuery(f"{name}={raw!r} is not an integer") from None
        if not -1 <= value <= _MAX_INDEX:
            raise _BadQuery(f"{name}={value} out of range [-1, {_MAX_INDEX}]")
        return value

    engine_rank = integer("engine_rank", True)
    dp_group = integer("target_dp_group", True)
    pp_rank = integer("target_pp_rank", False)
    assert engine_rank is not None and dp_group is not None  # required above
    extras = {name: v for name in optional if (v := one(name, False)) is not None}
    whole_node = engine_rank == -1 and dp_group == -1 and pp_rank in (None, -1)
    if not whole_node and min(engine_rank, dp_group, 0 if pp_rank is None else pp_rank) < 0:
        raise _BadQuery(
            "-1 is only valid as engine_rank=-1&target_dp_group=-1 (whole node); got "
            f"engine_rank={engine_rank}, target_dp_group={dp_group}, target_pp_rank={pp_rank}"
        )
    return engine_rank, dp_group, pp_rank, extras


_Handler = Callable[[web.Request], Awaitable[web.Response]]


def _bad_query(handler: _Handler) -> _Handler:
    async def wrapped(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except _BadQuery as exc:
            return _error(400, f"bad query: {exc}")

    return wrapped


async def _put_route(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    limits = request.app[LIMITS_KEY]
    try:
        body = await read_body(request, limits)  # 413 over the limit, 408 too slow
        reason = json_too_deep(body, limits.max_depth)
        if reason is not None:
            raise BodyError(400, reason)
    except BodyError as exc:
        return _error(exc.status, f"invalid registration: {exc.message}")
    try:
        info = msgspec.json.decode(body, type=RankInfo)
    except msgspec.ValidationError as exc:
        logger.warning("rejected registration from %s: %s", request.remote, exc)
        return _error(400, f"invalid registration: {exc}")
    except msgspec.DecodeError as exc:
        return _error(400, f"invalid registration: body is not JSON: {exc}")
    try:
        old = registry.register(info)
    except RegistryConflict as exc:
        logger.warning("rejected registration from %s: %s", request.remote, exc)
        return _error(400, str(exc))
    return _reply({"status": "registered" if old is None else "replaced"})


@_bad_query
async def _get_route(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    engine_rank, dp_group, pp_rank, _ = _query(request, ())
    layout = registry.layout()
    if engine_rank == -1:
        if layout is None:
            return _error(404, "no prefill rank is registered yet")
        return _reply(layout)
    pp_rank = pp_rank or 0
    if layout is not None:
        # A rank outside the node's layout will never register: say so now instead of a 404
        # the decode would retry until its timeout.
        for name, value, size_name, size in (
            ("engine_rank", engine_rank, "tp_size", layout.tp_size),
            ("target_dp_group", dp_group, "dp_size", layout.dp_size),
            ("target_pp_rank", pp_rank, "pp_size", layout.pp_size),
        ):
            if value >= size:
                raise _BadQuery(f"{name}={value} out of range: this prefill has {size_name} {size}")
    info = registry.lookup(dp_group, engine_rank, pp_rank)
    if info is None:
        have = 0 if layout is None else layout.registered_ranks
        return _error(404, f"prefill rank {format_key((dp_group, engine_rank, pp_rank))} is not registered ({have} rank(s) are)")
    return _reply(info)


@_bad_query
async def _delete_route(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    engine_rank, dp_group, pp_rank, extras = _query(request, ("instance_id",))
    if engine_rank == -1:
        if extras:
            raise _BadQuery("instance_id applies to one rank, not to engine_rank=-1&target_dp_group=-1")
        return _reply({"removed": registry.clear()})
    key = (dp_group, engine_rank, pp_rank or 0)
    try:
        removed = registry.deregister(*key, instance_id=extras.get("instance_id"))
    except RegistryConflict as exc:
        return _error(409, str(exc))
    if removed is None:
        return _error(404, f"prefill rank {format_key(key)} is not registered")
    return _reply({"removed": 1})


async def _get_routes(request: web.Request) -> web.Response:
    return _reply(request.app[REGISTRY_KEY].ranks())


def _always_healthy() -> bool:
    return True


async def _health(request: web.Request) -> web.Response:
    try:
        healthy = request.app[HEALTH_KEY]()
    except Exception as exc:  # a broken probe is an unhealthy node, not a 500
        return web.Response(status=503, text=f"health check failed: {exc!r}")
    return web.Response(text="OK") if healthy else web.Response(status=503, text="unhealthy")


def _require_secret(secret: str):  # type: ignore[no-untyped-def]
    """Every route but ``GET /health`` needs a request token made from ``secret`` (common/auth.py):
    the secret itself never travels, and a recorded token is good for nothing else."""
    verifier = RequestVerifier(secret)
    refusals = RefusalLog(logger, "a registry request without a valid cluster-secret token")

    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.method == "GET" and request.path == "/health":
            return await handler(request)
        try:  # the token covers the body: read it here, under the same limits the routes use
            body = await read_body(request, request.app[LIMITS_KEY])
        except BodyError as exc:
            return _error(exc.status, exc.message)
        reason = verifier.check(request.headers.get("Authorization"), request.method, request.raw_path, body)
        if reason is None:
            challenge = request.headers.get(CHALLENGE_HEADER)
            # A node checks that this registry is its cluster's: every answer to it proves the secret.
            proven = ({PROOF_HEADER: proof(secret, challenge, "registry")}
                      if challenge and len(challenge) <= MAX_CHALLENGE_CHARS else {})
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # aiohttp's own answers (unknown path, wrong method)
                exc.headers.update(proven)
                raise
            response.headers.update(proven)
            return response
        refusals.refused(f"{request.method} {request.path} from {request.remote}: {reason}")
        return web.Response(status=401, body=_json.encode({"error": "the bootstrap registry requires a request "
                                                                    "token made from the cluster secret"}),
                            content_type="application/json", headers={"WWW-Authenticate": WWW_AUTHENTICATE})

    return middleware


def make_app(registry: Registry | None = None, health_check: HealthCheck | None = None,
             secret: str | None = None, limits: BodyLimits = DEFAULT_LIMITS) -> web.Application:
    """The aiohttp application; pass a ``registry`` to share it with in-process code.

    ``health_check`` lets an embedding process make ``/health`` (the decode's heartbeat target)
    fail when its scheduler is stuck although this server's thread still answers. ``secret``:
    the cluster secret every other route requires (None: open). ``limits``: how large and how slow
    a body may be.
    """
    app = web.Application(client_max_size=limits.max_bytes, middlewares=[_require_secret(secret)] if secret else [])
    app[LIMITS_KEY] = limits
    app[REGISTRY_KEY] = registry if registry is not None else Registry()
    app[HEALTH_KEY] = health_check if health_check is not None else _always_healthy
    app.router.add_put("/route", _put_route)
    app.router.add_get("/route", _get_route)
    app.router.add_delete("/route", _delete_route)
    app.router.add_get("/routes", _get_routes)
    app.router.add_get("/health", _health)
    return app


def _listen_socket(host: str, port: int) -> socket.socket:
    """Bind ourselves (rather than letting aiohttp) so port 0 works and the bound port is known."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"bootstrap server cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class AsyncBootstrapServer:
    """The registry served inside the caller's running event loop."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8998,
        registry: Registry | None = None,
        health_check: HealthCheck | None = None,
        secret: str | None = None,
        limits: BodyLimits = DEFAULT_LIMITS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        self.host = host
        self._limits = limits
        self._header_timeout_s = header_timeout_s
        self._requested_port = port
        self.registry = registry if registry is not None else Registry()
        self._health_check = health_check
        self._secret = secret
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        """The bound port (differs from the requested one when that was 0)."""
        if self._port is None:
            raise RuntimeError("bootstrap server is not started")
        return self._port

    @property
    def url(self) -> str:
        return bootstrap_url(self.host, self.port)

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("bootstrap server already started")
        sock = _listen_socket(self.host, self._requested_port)
        # access_log=None: decode heartbeats hit /health every second per prefill. aiohttp closes a
        # connection whose request head has not arrived keepalive_timeout after it opened or after
        # its last response: the header timeout (slowloris), idle keep-alive included.
        runner = web.AppRunner(make_app(self.registry, self._health_check, self._secret, self._limits),
                               access_log=None, shutdown_timeout=1.0, keepalive_timeout=self._header_timeout_s)
        try:
            await runner.setup()
            await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        self._port = sock.getsockname()[1]
        logger.info("bootstrap server listening on %s", self.url)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            logger.info("bootstrap server on port %s stopped", self._port)

    async def __aenter__(self) -> AsyncBootstrapServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class BootstrapServer:
    """The registry served from its own event loop in a daemon thread (embedded in a prefill process).

    ``start()`` returns once the port is listening and raises the bind error if it cannot be;
    ``stop()`` closes the listener and its connections and joins the thread. Both are idempotent.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8998,
        registry: Registry | None = None,
        health_check: HealthCheck | None = None,
        secret: str | None = None,
        limits: BodyLimits = DEFAULT_LIMITS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        # health_check runs on the server's thread: keep it a cheap, thread-safe read.
        self._server = AsyncBootstrapServer(host, port, registry, health_check, secret, limits, header_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def registry(self) -> Registry:
        return self._server.registry

    @property
    def host(self) -> str:
        return self._server.host

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def url(self) -> str:
        return self._server.url

    def start(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._server.start())
            except BaseException as exc:  # handed to start()'s caller
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._server.stop())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=run, name="bootstrap-server", daemon=True)
        thread.start()
        if not started.wait(timeout_s):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            raise TimeoutError(f"bootstrap server did not start within {timeout_s}s")
        if failure:
            thread.join(timeout_s)
            raise failure[0]
        self._loop, self._thread = loop, thread

    def stop(self, timeout_s: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # the loop already closed (its thread died): nothing left to stop
            pass
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("bootstrap server thread did not stop within %ss", timeout_s)

    def __enter__(self) -> BootstrapServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
