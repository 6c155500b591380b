"""Who is calling the router, and how much they may ask: keys, roles and rate limits.

A keys file (``--keys-file PATH``, JSON, reloaded on SIGHUP) names every client::

    {"keys": [
      {"key": "<at least 16 chars>", "name": "alice", "role": "client",
       "requests_per_min": 60, "tokens_per_min": 20000,
       "endpoints": ["/v1/chat/completions", "/v1/models"]},
      {"key": "...", "name": "ops", "role": "operator"}
    ]}

``role`` is ``client`` (the default) or ``operator`` (router/auth.py says what each may call);
the limits and ``endpoints`` are optional (absent: unlimited, every endpoint of the role).
``--api-key`` and ``--operator-key`` are two more entries, named ``api-key`` and ``operator``,
without limits.

Lookup is a dict keyed by the SHA-256 of the key: the key itself is never held in a structure
that compares it byte by byte, and a timing difference can only tell an attacker how a digest of
their guess compares to a digest of a key, which says nothing of the key (preimage resistance).

Limits are token buckets per client: ``requests_per_min`` takes one per request, at arrival;
``tokens_per_min`` takes an estimate of the tokens a generation request may cost (its body's
bytes / 4 for the prompt, plus the most tokens it may generate), after it is parsed (the router
has no tokenizer). A request over either limit is a 429 with ``Retry-After`` (seconds until the
bucket holds enough) and touches no worker. A bucket holds at most one minute's worth.

The estimate is settled when the response is done (``settle``): against the prompt and
completion tokens the nodes reported (``usage`` / ``meta_info``), a request that failed without
an answer is refunded in full, and one whose usage is unknown (a stream cut off) keeps the
estimate. A refund never fills the bucket past one minute's worth; a charge beyond the estimate
(a prompt of more than one token per 4 bytes) never takes it deeper than one minute's worth of
debt, which the refill pays before the client's next request goes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field

from common.auth import SecretError, check_secret

log = logging.getLogger("router.clients")
ROLES = ("client", "operator")


@dataclass(frozen=True)
class ClientSpec:
    name: str
    role: str = "client"
    requests_per_min: float | None = None
    tokens_per_min: float | None = None
    endpoints: frozenset[str] | None = None  # None: every endpoint its role may call

    def may_call(self, path: str) -> bool:
        return self.endpoints is None or path in self.endpoints


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the entry."""


def parse_keys(text: str, where: str) -> dict[bytes, ClientSpec]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise KeysFileError(f"{where}: not JSON: {exc}") from exc
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise KeysFileError(f'{where}: expected {{"keys": [...]}}')
    table: dict[bytes, ClientSpec] = {}
    names: set[str] = set()
    for i, e in enumerate(entries):
        what = f"{where}: keys[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or not isinstance(e.get("name"), str):
            raise KeysFileError(f"{what}: needs a string 'key' and a string 'name'")
        unknown = set(e) - {"key", "name", "role", "requests_per_min", "tokens_per_min", "endpoints"}
        if unknown:
            raise KeysFileError(f"{what}: unknown fields {sorted(unknown)}")
        try:
            check_secret(e["key"], f"{what}.key")
        except SecretError as exc:
            raise KeysFileError(str(exc)) from exc
        name, role = e["name"], e.get("role", "client")
        if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
            raise KeysFileError(f"{what}: name {name!r} must be 1-64 letters, digits, '-' or '_' (a metrics label)")
        if name in names:
            raise KeysFileError(f"{what}: name {name!r} is used twice")
        if role not in ROLES:
            raise KeysFileError(f"{what}: role {role!r} must be one of {list(ROLES)}")
        limits = {}
        for f in ("requests_per_min", "tokens_per_min"):
            v = e.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise KeysFileError(f"{what}: {f} must be a number > 0")
            limits[f] = None if v is None else float(v)
        endpoints = e.get("endpoints")
        if endpoints is not None and (not isinstance(endpoints, list) or not all(isinstance(p, str) and p.startswith("/")
                                                                                 for p in endpoints)):
            raise KeysFileError(f"{what}: endpoints must be a list of paths")
        digest = _digest(e["key"])
        if digest in table:
            raise KeysFileError(f"{what}: the same key is listed twice")
        names.add(name)
        table[digest] = ClientSpec(name, role, limits["requests_per_min"], limits["tokens_per_min"],
                                   None if endpoints is None else frozenset(endpoints))
    return table


@dataclass
class _Bucket:
    per_min: float
    level: float
    at: float

    def take(self, amount: float, now: float) -> float:
        """0 when ``amount`` was taken, else seconds until it could be (nothing taken)."""
        rate = self.per_min / 60.0
        self.level = min(self.per_min, self.level + (now - self.at) * rate)
        self.at = now
        # More than a minute's worth never fits the bucket: it goes once the bucket is full and
        # leaves it in debt, which the refill pays before anything else goes.
        need = min(amount, self.per_min)
        if need <= self.level:
            self.level -= amount
            return 0.0
        return (need - self.level) / rate

    def adjust(self, delta: float, now: float) -> None:
        """Refund (``delta`` > 0) or charge (< 0) after the fact: refilled to ``now`` first, never
        above a minute's worth, and a charge never below a minute's worth of debt (a debt an
        oversized request already left stays as it is)."""
        self.level = min(self.per_min, self.level + (now - self.at) * self.per_min / 60.0)
        self.at = now
        if delta > 0:
            self.level = min(self.per_min, self.level + delta)
        elif delta < 0:
            self.level = max(min(self.level, -self.per_min), self.level + delta)


@dataclass
class Clients:
    """The keys the router knows (file + flags) and each client's buckets."""

    api_key: str | None = None
    operator_key: str | None = None
    keys_file: str | None = None
    _table: dict[bytes, ClientSpec] = field(default_factory=dict)
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.reload()  # a bad file at start-up raises (the router exits 2 naming it)

    @property
    def enabled(self) -> bool:
        return bool(self._table)

    @property
    def has_client(self) -> bool:
        return any(s.role == "client" for s in self._table.values())

    @property
    def has_operator(self) -> bool:
        return any(s.role == "operator" for s in self._table.values())

    def _flag_entries(self) -> dict[bytes, ClientSpec]:
        out = {}
        if self.api_key:
            out[_digest(self.api_key)] = ClientSpec("api-key", "client")
        if self.operator_key:
            out[_digest(self.operator_key)] = ClientSpec("operator", "operator")
        return out

    def reload(self) -> None:
        """Read the keys file again (SIGHUP). A bad file keeps the keys in force and raises."""
        table = self._flag_entries()
        if self.keys_file is not None:
            try:
                with open(self.keys_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise KeysFileError(f"--keys-file {self.keys_file}: {exc}") from exc
            from_file = parse_keys(text, f"--keys-file {self.keys_file}")
            clash = set(from_file) & set(table)
            if clash:
                raise KeysFileError(f"--keys-file {self.keys_file}: a key equals --api-key or --operator-key")
            table |= from_file
        with self._lock:
            self._table = table
            names = {s.name for s in table.values()}
            self._buckets = {k: b for k, b in self._buckets.items() if k[0] in names}  # limits may change
        log.info("router keys: %d (%s)", len(table), ", ".join(sorted(names)) or "none")

    def identify(self, authorization: str | None) -> ClientSpec | None:
        """The client a bearer token belongs to (None: no or unknown token)."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._table.get(_digest(token.strip()))

    def take(self, client: ClientSpec, kind: str, amount: float, now: float | None = None) -> float:
        """Take ``amount`` from ``client``'s ``kind`` bucket ("requests" | "tokens"): 0 when it
        may go, else the seconds to tell it to wait (429 Retry-After)."""
        per_min = client.requests_per_min if kind == "requests" else client.tokens_per_min
        if per_min is None:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._buckets.get((client.name, kind))
            if bucket is None or bucket.per_min != per_min:
                bucket = self._buckets[(client.name, kind)] = _Bucket(per_min, per_min, now)
            return bucket.take(amount, now)

    def settle(self, client: ClientSpec, kind: str, charged: float, used: float, now: float | None = None) -> None:
        """``charged`` was taken from ``client``'s ``kind`` bucket at admission; the request
        turned out to cost ``used``: give back or take the difference (``_Bucket.adjust``). A
        bucket reset meanwhile (limits changed by a reload) is left alone."""
        per_min = client.requests_per_min if kind == "requests" else client.tokens_per_min
        if per_min is None or used == charged:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            bucket = self._buckets.get((client.name, kind))
            if bucket is not None and bucket.per_min == per_min:
                bucket.adjust(charged - used, now)


def retry_after(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))


DEFAULT_MAX_NEW = 128  # what a /generate body without max_new_tokens gets on the nodes


def token_estimate(body: object, body_bytes: int, sequences: int) -> float:
    """What a generation request may cost, before any tokenizer saw it: ~4 bytes a prompt token,
    plus the most tokens each of its sequences may generate."""
    most = DEFAULT_MAX_NEW
    if isinstance(body, dict):
        sp = body.get("sampling_params")
        for v in (body.get("max_completion_tokens"), body.get("max_tokens"),
                  sp.get("max_new_tokens") if isinstance(sp, dict) else None):
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                most = v
                break
    return body_bytes / 4 + max(1, sequences) * most
