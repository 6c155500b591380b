"""Shared secrets of a pdcluster deployment: reading them, checking them, presenting them.

Two secrets, both off unless configured (the local demo runs without them):

    API key         clients -> router             Authorization: Bearer <api key>
    cluster secret  router -> nodes               Authorization: Bearer <cluster secret>
                    nodes  -> bootstrap registry  Authorization: Bearer <cluster secret>
                    decode <-> prefill (ZMQ)      HMAC-SHA256 tag keyed from it (transfer/control_auth.py)

The cluster secret travels as a bearer token (not a header of our own) because that is the one
header sglang-router 0.3.2 sends to workers (``--api-key``). Each value comes from a flag, a file
(``--*-file``: a mounted Kubernetes Secret) or its ``PDC_*`` variable, in that order, and must be
at least ``MIN_SECRET_CHARS`` printable ASCII characters without whitespace (it is an HTTP header
value). Comparisons are constant-time. Stdlib only: the router imports this without torch.
"""
from __future__ import annotations

import hmac
import logging
import threading
import time

from common.envs import EnvVar

MIN_SECRET_CHARS = 16
AUTHORIZATION = "Authorization"
WWW_AUTHENTICATE = 'Bearer realm="pdcluster"'
_REFUSAL_LOG_PERIOD_S = 10.0


class SecretError(ValueError):
    """A secret that is malformed or cannot be read; the message names where it came from."""


def check_secret(value: str, what: str) -> str:
    """``value`` if it can be a bearer token of ours, else ``SecretError`` naming ``what``."""
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
