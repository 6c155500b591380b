"""Shared secrets of a pdcluster deployment: reading them, checking them, proving them.

Two secrets, both off unless configured (the local demo runs without them):

    API key         clients -> router             Authorization: Bearer <api key>
    cluster secret  router -> nodes               Authorization: PDC-HMAC <request token>
                    nodes  -> bootstrap registry  Authorization: PDC-HMAC <request token>
                    decode <-> prefill (ZMQ)      HMAC-SHA256 tag keyed from it (transfer/control_auth.py)

The cluster secret never crosses the wire. A request to a node or a registry carries a request
token instead: an HMAC over the method, the path with its query, a timestamp, a random nonce and
the SHA-256 of the body, keyed from the secret::

    Authorization: PDC-HMAC ts=<unix seconds>,nonce=<24 hex>,mac=<64 hex>
    mac = HMAC-SHA256(K_req, "METHOD\n/path?query\nts\nnonce\n" || SHA-256(body))
    K_req = HMAC-SHA256(secret, "pdcluster/http-request/v1")

The receiver (``RequestVerifier``) accepts a token once, within ``TOKEN_WINDOW_S`` of its own
clock: a recorded token is worthless for another request (the MAC covers it), for the same
request again (the nonce was seen), and after the window (the timestamp). Whoever sees a token
learns nothing reusable.

Before the router sends a worker anything that carries a token, the worker proves it holds the
secret: the router's health probe carries a fresh challenge (``GET /health?challenge=<nonce>``)
and a worker with the secret answers with ``X-PDC-Proof: HMAC(K_proof, nonce)`` (``proof``).
A stranger's endpoint added as a worker gets no token, no prompt, nothing but the challenge.
Likewise a registry proves the secret on every answer to a node (``X-PDC-Challenge`` in the
request, the proof in the answer, a key of its own): a decode sent to a stranger's "registry" by a
request's ``bootstrap_host`` fails that request at once, before it reserves a page or tells
anyone where its buffers are.

sglang-router 0.3.2 can only send its one ``--api-key`` as a bearer token; a node started with
``--accept-bearer-secret`` also accepts ``Authorization: Bearer <cluster secret>`` for that case
(and the secret then crosses the wire, as it must for sglang-router).

Each value comes from a flag, a file (``--*-file``: a mounted Kubernetes Secret) or its ``PDC_*``
variable, in that order, and must be at least ``MIN_SECRET_CHARS`` printable ASCII characters
without whitespace. Comparisons are constant-time. Stdlib only: the router imports this without torch.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections import OrderedDict
from urllib.parse import urlsplit

from common.envs import EnvVar

MIN_SECRET_CHARS = 16
# deploy/k8s/base ships values starting with this: public, so a process given one refuses to start.
PLACEHOLDER_PREFIX = "replace-me"
AUTHORIZATION = "Authorization"
WWW_AUTHENTICATE = 'Bearer realm="pdcluster"'
TOKEN_SCHEME = "PDC-HMAC"
PROOF_HEADER = "X-PDC-Proof"
CHALLENGE_HEADER = "X-PDC-Challenge"
MAX_CHALLENGE_CHARS = 128  # a longer one is not answered (ours are 32 hex characters)
# How far a token's timestamp may be from the receiver's clock, either way. Wide enough for the
# clock skew between pods and a request queued in a connection pool; every token seen inside it
# is remembered, so a replay within the window is caught by its nonce instead.
TOKEN_WINDOW_S = 60.0
# Bound on remembered nonces: only tokens with a valid MAC are remembered, so this is reached only
# by a legitimate rate above MAX_NONCES / (2 * TOKEN_WINDOW_S) requests/s (~800/s per node).
MAX_NONCES = 100_000
_REQUEST_CONTEXT = b"pdcluster/http-request/v1"
_REFUSAL_LOG_PERIOD_S = 10.0


class SecretError(ValueError):
    """A secret that is malformed or cannot be read; the message names where it came from."""


def check_secret(value: str, what: str) -> str:
    """``value`` if it can be a bearer token of ours, else ``SecretError`` naming ``what``."""
    if value.startswith(PLACEHOLDER_PREFIX):
        raise SecretError(f"{what} is the public placeholder of deploy/k8s (it starts with {PLACEHOLDER_PREFIX!r}): "
                          "put a real one in your overlay's auth.env (`openssl rand -hex 32`)")
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"{what} must be at least {MIN_SECRET_CHARS} characters (got {len(value)}); "
                          "make one with `openssl rand -hex 32`")
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise SecretError(f"{what} must be printable ASCII without spaces (it is sent as an HTTP header)")
    return value


def read_secret_file(path: str, what: str) -> str:
    """The file's content without surrounding whitespace (a mounted Secret often ends in a newline)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"{what}: cannot read {path!r}: {exc}") from exc
    if not value:
        raise SecretError(f"{what}: {path!r} is empty")
    return value


def resolve_secret(value: str | None, path: str | None, env: EnvVar[str], flag: str) -> str | None:
    """The secret from ``--flag`` (``value``), ``--flag-file`` (``path``) or ``env``; None when none
    is set. Giving both the flag and its file is an error, not a silent choice."""
    if value is not None and path is not None:
        raise SecretError(f"give {flag} or {flag}-file, not both")
    if value is not None:
        return check_secret(value, flag)
    if path is not None:
        return check_secret(read_secret_file(path, f"{flag}-file"), f"{flag}-file {path}")
    from_env = env.get()
    return check_secret(from_env, env.name) if from_env else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (then no secret is needed to keep strangers out)."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: assume others can reach it


def check_exposure(host: str, secret: str | None, insecure: bool, what: str) -> None:
    """Refuse (``SecretError``) to listen beyond this machine without a cluster secret unless
    ``insecure``; say so loudly when it is given."""
    if secret is not None or is_loopback(host):
        return
    if not insecure:
        raise SecretError(f"this {what} listens on {host!r}, reachable from other machines, and has no cluster "
                          "secret: set PDC_CLUSTER_SECRET (or --cluster-secret-file; make one with `openssl rand "
                          "-hex 32`), or pass --insecure to run open anyway")
    logging.getLogger("pdcluster.auth").warning(
        "INSECURE: this %s listens on %r without a cluster secret (--insecure): anyone who can reach it can "
        "generate, abort every request, flush caches and redirect KV writes", what, host)


def bearer(secret: str | None) -> dict[str, str]:
    """The request header that presents ``secret`` (none without one)."""
    return {AUTHORIZATION: f"Bearer {secret}"} if secret else {}


def bearer_matches(header: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header value carries exactly ``secret`` (constant-time)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), secret.encode())


class RefusalLog:
    """Logs refused callers without letting a flood of them flood the log: the first refusal
    at once, then at most one line per period with the count since."""

    def __init__(self, logger: logging.Logger, what: str, period_s: float = _REFUSAL_LOG_PERIOD_S) -> None:
        self._log, self._what, self._period = logger, what, period_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._pending = 0
        self.total = 0

    def refused(self, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._pending += 1
            if now - self._last < self._period:
                return
            count, self._pending, self._last = self._pending, 0, now
        self._log.warning("refused %s: %s (%d refused since the last report)", self._what, detail, count)


# ---- request tokens: the cluster secret proven, never sent ---------------------------------------


def _derive(secret: str, context: bytes) -> bytes:
    return hmac.new(secret.encode(), context, hashlib.sha256).digest()


def request_target(url: str) -> str:
    """The path with its query, as an HTTP request line carries it (what a token covers)."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _mac(key: bytes, method: str, target: str, ts: str, nonce: str, body: bytes) -> str:
    head = f"{method.upper()}\n{target}\n{ts}\n{nonce}\n".encode("utf-8", "surrogateescape")
    return hmac.new(key, head + hashlib.sha256(body).digest(), hashlib.sha256).hexdigest()


class RequestSigner:
    """Makes request tokens for one secret; thread-safe (no state)."""

    def __init__(self, secret: str) -> None:
        self._key = _derive(secret, _REQUEST_CONTEXT)

    def __repr__(self) -> str:
        return "RequestSigner(<secret>)"

    def authorization(self, method: str, target: str, body: bytes = b"", now: float | None = None) -> str:
        """The ``Authorization`` value for one request (``target``: path and query)."""
        ts, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(12)
        return f"{TOKEN_SCHEME} ts={ts},nonce={nonce},mac={_mac(self._key, method, target, ts, nonce, body)}"

    def headers(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        return {AUTHORIZATION: self.authorization(method, request_target(url), body)}


def signed_headers(secret: str | None, method: str, url: str, body: bytes = b"") -> dict[str, str]:
    """The headers that authenticate one request to a node or registry (none without a secret)."""
    return RequestSigner(secret).headers(method, url, body) if secret else {}


class RequestVerifier:
    """Checks request tokens (and, with ``accept_bearer``, the bare secret sglang-router sends).

    ``check`` returns None for an accepted request, else the reason (for the refusal log; the
    client gets only a 401). Each accepted nonce is remembered until its token expires.
    """

    def __init__(self, secret: str, *, accept_bearer: bool = False, window_s: float = TOKEN_WINDOW_S,
                 max_nonces: int = MAX_NONCES) -> None:
        self._secret = secret
        self._key = _derive(secret, _REQUEST_CONTEXT)
        self._accept_bearer = accept_bearer
        self._window = window_s
        self._max = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "RequestVerifier(<secret>)"

    def check(self, header: str | None, method: str, target: str, body: bytes = b"",
              now: float | None = None) -> str | None:
        if not header:
            return "no Authorization header"
        scheme, _, rest = header.strip().partition(" ")
        if scheme.lower() == "bearer":
            if self._accept_bearer and bearer_matches(header, self._secret):
                return None
            return "a bearer token (this node takes request tokens; see --accept-bearer-secret)" \
                if not self._accept_bearer else "a wrong bearer token"
        if scheme != TOKEN_SCHEME:
            return f"an unknown Authorization scheme {scheme[:20]!r}"
        fields = dict(kv.partition("=")[::2] for kv in rest.strip().split(","))
        ts, nonce, mac = fields.get("ts", ""), fields.get("nonce", ""), fields.get("mac", "")
        if not (ts.isdigit() and len(ts) <= 12 and 16 <= len(nonce) <= 64 and nonce.isalnum() and len(mac) == 64):
            return "a malformed request token"
        if not hmac.compare_digest(mac, _mac(self._key, method, target, ts, nonce, body)):
            return "a request token with a wrong MAC (another secret, or another request's token)"
        now = time.time() if now is None else now
        if abs(now - int(ts)) > self._window:
            return f"an expired request token (its clock is {now - int(ts):+.0f} s from ours)"
        with self._lock:
            while self._seen and (len(self._seen) >= self._max or next(iter(self._seen.values())) < now):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "a replayed request token"
            self._seen[nonce] = int(ts) + self._window  # ts-ordered within the window: FIFO is close enough
        return None


def proof(secret: str, challenge: str, purpose: str = "worker") -> str:
    """What a holder of ``secret`` answers to ``challenge`` (hex HMAC). ``purpose`` keys each kind
    of proof apart: a node's open ``/health`` answers worker challenges, so a registry proof must
    not be obtainable there (else a rogue registry could relay a decode's challenge to a node)."""
    key = _derive(secret, f"pdcluster/{purpose}-proof/v1".encode())
    return hmac.new(key, challenge.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def new_challenge() -> str:
    return secrets.token_hex(16)


def proof_matches(secret: str, challenge: str, answer: str | None, purpose: str = "worker") -> bool:
    return answer is not None and hmac.compare_digest(answer.strip().encode(), proof(secret, challenge, purpose).encode())
