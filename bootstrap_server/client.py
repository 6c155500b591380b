"""Synchronous client of the bootstrap registry, for transfer-layer threads (no asyncio).

Stable API (``url`` is ``"host:port"`` or ``"http://host:port"``; ``bootstrap_url`` builds one)::

    register_rank(url, info: RankInfo, timeout_s=5.0, *, secret=None) -> None       # PUT /route
    lookup_rank(url, engine_rank, dp_group, timeout_s=5.0, *, pp_rank=0,
                retry_interval_s=0.1, secret=None) -> RankInfo                        # GET /route
    lookup_layout(url, timeout_s=5.0, *, retry_interval_s=0.1, secret=None,
                  complete=False) -> PrefillLayout                                  # every rank in
    deregister(url, engine_rank, dp_group, *, pp_rank=0, instance_id=None,
               timeout_s=5.0, secret=None) -> bool                                    # DELETE /route
    list_ranks(url, timeout_s=5.0, *, secret=None) -> list[RankInfo]                  # GET /routes
    health(url, timeout_s=1.0) -> bool                                                # GET /health
    bootstrap_url(host, port) -> str

``secret``: the cluster secret, sent as ``Authorization: Bearer``; a registry that has one
answers 401 to every call but ``health`` without it (a ``BootstrapError`` with status 401).

Errors (``bootstrap_server.errors``, all subclasses of ``BootstrapError``, which carries the
server's ``reason``, the ``url`` and the HTTP ``status``):

- ``BootstrapUnreachable``: refused / reset / timed out / DNS. Raised at once, never retried: a
  dead port fails in milliseconds, a black-holed host after at most ``timeout_s``.
- ``RankNotRegistered``: 404. The lookups retry it (the rank may still be starting) until
  ``timeout_s`` has passed since the call began, then raise it. ``timeout_s=0`` asks once.
- ``BootstrapError``: 400 (the reason names the bad field or the layout conflict), 5xx, or an
  answer that does not decode.

``health`` never raises: it is the heartbeat's probe and answers ``False`` on any failure.
``deregister`` answers whether it removed something (``False``: not registered, or registered by
another ``instance_id``); ``engine_rank=-1, dp_group=-1`` removes every rank.

Decode-side recipe (fail at lookup time, not per request)::

    layout = lookup_layout(url, timeout_s)
    check_receivable(layout, DecodeLayout.from_kv_layout(kv_layout, tp_size=tp_size))  # LayoutMismatch
    info = lookup_rank(url, engine_rank=tp_rank, dp_group=room % layout.dp_size, timeout_s=timeout_s)
    zmq_push.connect(info.endpoint)

Every function is thread-safe and opens a fresh connection; HTTP proxies from the environment
are ignored (the registry is always reached directly).
"""
from __future__ import annotations

import http.client
import ipaddress
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TypeVar

import msgspec

from bootstrap_server.errors import BootstrapError, BootstrapUnreachable, RankNotRegistered
from bootstrap_server.schema import PrefillLayout, RankInfo
from common.auth import CHALLENGE_HEADER, PROOF_HEADER, new_challenge, proof_matches, signed_headers

DEFAULT_TIMEOUT_S = 5.0
_MAX_RETRY_INTERVAL_S = 1.0
# Even a nearly expired deadline gets this long per attempt, so the last try is a real one.
_MIN_ATTEMPT_S = 0.1

T = TypeVar("T")

# ProxyHandler({}): an http_proxy set for model downloads must not capture cluster-internal calls.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def bootstrap_url(host: str, port: int) -> str:
    """``http://host:port`` with IPv6 literals bracketed; a wildcard host means this machine."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"http://{host}:{port}"
    if addr.is_unspecified:
        addr = ipaddress.ip_address("::1" if addr.version == 6 else "127.0.0.1")
    return f"http://[{addr}]:{port}" if addr.version == 6 else f"http://{addr}:{port}"


def _base(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _reason(body: bytes) -> str:
    """The server's ``{"error": ...}`` text, or the raw body when it is not ours."""
    try:
        err = msgspec.json.decode(body, type=dict[str, str]).get("error")
    except (msgspec.DecodeError, msgspec.ValidationError):
        err = None
    return err or body.decode("utf-8", "replace")[:500] or "(empty body)"


def _request(method: str, url: str, timeout_s: float, body: bytes | None = None,
             secret: str | None = None) -> tuple[int, bytes]:
    """One HTTP exchange; any status comes back, only transport failures raise."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    headers.update(signed_headers(secret, method, url, body or b""))
    challenge = new_challenge() if secret else None
    if challenge is not None:
        headers[CHALLENGE_HEADER] = challenge
    try:
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        with _opener.open(req, timeout=timeout_s) as resp:
            status, data, answer = resp.status, resp.read(), resp.headers.get(PROOF_HEADER)
    except urllib.error.HTTPError as exc:  # a 4xx/5xx is an answer, not a transport failure
        with exc:
            status, data, answer = exc.code, exc.read(), exc.headers.get(PROOF_HEADER)
    except urllib.error.URLError as exc:
        raise BootstrapUnreachable(f"bootstrap server unreachable: {exc.reason}", url=url) from exc
    except (OSError, http.client.HTTPException) as exc:  # timeouts, resets mid-answer
        raise BootstrapUnreachable(f"bootstrap server unreachable: {exc!r}", url=url) from exc
    except ValueError as exc:  # malformed URL
        raise BootstrapError(f"invalid bootstrap url: {exc}", url=url) from exc
    if secret is not None and challenge is not None and not proof_matches(secret, challenge, answer, "registry"):
        # Not our cluster's registry (a request's bootstrap_host naming a stranger's listener), or
        # one with another secret: nothing it said is believed, so nothing is reserved or sent.
        reason = _reason(data) if status == 401 else "no proof of the cluster secret in its answer"
        raise BootstrapError(f"the bootstrap server is not this cluster's (it did not prove the cluster secret: "
                             f"{reason})", url=url, status=401)
    return status, data


def _decode(body: bytes, type_: type[T], url: str) -> T:
    try:
        return msgspec.json.decode(body, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BootstrapError(f"unexpected answer from bootstrap server: {exc}", url=url, status=200) from exc


def _get_retrying_404(url: str, type_: type[T], timeout_s: float, retry_interval_s: float, secret: str | None) -> T:
    deadline = time.monotonic() + timeout_s
    interval = retry_interval_s
    while True:
        status, body = _request("GET", url, max(deadline - time.monotonic(), _MIN_ATTEMPT_S), secret=secret)
        if status == 200:
            return _decode(body, type_, url)
        if status != 404:
            raise BootstrapError(_reason(body), url=url, status=status)
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankNotRegistered(f"{_reason(body)} (gave up after {timeout_s:g}s)", url=url, status=404)
        time.sleep(min(interval, left))
        interval = min(interval * 2, _MAX_RETRY_INTERVAL_S)


def _route_query(engine_rank: int, dp_group: int, pp_rank: int | None, **extra: str | None) -> str:
    params: dict[str, str | int] = {"engine_rank": engine_rank, "target_dp_group": dp_group}
    if pp_rank is not None:
        params["target_pp_rank"] = pp_rank
    params.update({k: v for k, v in extra.items() if v is not None})
    return urllib.parse.urlencode(params)


def register_rank(url: str, info: RankInfo, timeout_s: float = DEFAULT_TIMEOUT_S, *, secret: str | None = None) -> None:
    """Register (or replace) one prefill rank; ``BootstrapError`` carries the server's 400 reason."""
    target = f"{_base(url)}/route"
    status, body = _request("PUT", target, timeout_s, msgspec.json.encode(info), secret)
    if status != 200:
        raise BootstrapError(_reason(body), url=target, status=status)


def lookup_rank(
    url: str,
    engine_rank: int,
    dp_group: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    pp_rank: int = 0,
    retry_interval_s: float = 0.1,
    secret: str | None = None,
) -> RankInfo:
    """Where prefill rank ``(dp_group, engine_rank, pp_rank)`` listens, waiting up to ``timeout_s`` for it."""
    if min(engine_rank, dp_group, pp_rank) < 0:
        raise ValueError(f"rank indices must be >= 0 (use lookup_layout for the node): {engine_rank}, {dp_group}, {pp_rank}")
    target = f"{_base(url)}/route?{_route_query(engine_rank, dp_group, pp_rank)}"
    return _get_retrying_404(target, RankInfo, timeout_s, retry_interval_s, secret)


def lookup_layout(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, retry_interval_s: float = 0.1,
                  secret: str | None = None, complete: bool = False) -> PrefillLayout:
    """The prefill node's parallel and KV layout, waiting up to ``timeout_s`` for a first rank.

    ``complete``: wait (within the same ``timeout_s``) until every rank of the node registered,
    and raise ``RankNotRegistered`` saying how many did if they do not: a decode that picked its
    source ranks from a half-registered node would wait for ranks that may never come."""
    target = f"{_base(url)}/route?{_route_query(-1, -1, None)}"
    deadline = time.monotonic() + timeout_s
    interval = retry_interval_s
    while True:
        layout = _get_retrying_404(target, PrefillLayout, max(deadline - time.monotonic(), 0.0), retry_interval_s, secret)
        if not complete or layout.complete:
            return layout
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankNotRegistered(f"prefill layout incomplete: {layout.registered_ranks} of {layout.expected_ranks} "
                                    f"ranks registered (gave up after {timeout_s:g}s)", url=target, status=404)
        time.sleep(min(interval, left))
        interval = min(interval * 2, _MAX_RETRY_INTERVAL_S)


def deregister(
    url: str,
    engine_rank: int,
    dp_group: int,
    *,
    pp_rank: int = 0,
    instance_id: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    secret: str | None = None,
) -> bool:
    """Remove a rank (``-1, -1``: every rank); ``False`` when nothing of it was registered."""
    whole_node = engine_rank == -1 and dp_group == -1
    query = _route_query(engine_rank, dp_group, None if whole_node else pp_rank, instance_id=instance_id)
    target = f"{_base(url)}/route?{query}"
    status, body = _request("DELETE", target, timeout_s, secret=secret)
    if status == 200:
        return _decode(body, dict[str, int], target).get("removed", 0) > 0
    if status in (404, 409):  # not registered / a newer incarnation owns it: nothing of ours left
        return False
    raise BootstrapError(_reason(body), url=target, status=status)


def list_ranks(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, secret: str | None = None) -> list[RankInfo]:
    """Every registered rank, ordered by ``(dp_group, engine_rank, pp_rank)``."""
    target = f"{_base(url)}/routes"
    status, body = _request("GET", target, timeout_s, secret=secret)
    if status != 200:
        raise BootstrapError(_reason(body), url=target, status=status)
    return _decode(body, list[RankInfo], target)


def health(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the server answers ``GET /health`` with 200 within ``timeout_s``; never raises."""
    try:
        status, _ = _request("GET", f"{_base(url)}/health", timeout_s)
    except BootstrapError:
        return False
    return status == 200
