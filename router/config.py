"""The router's command line and typed configuration (flag shapes as sglang-router's PD mode).

    pdcluster router --host H --port P --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...
                     [--policy least-loaded|cache-aware|power-of-two|round-robin|random]
                     [--api-key KEY | --api-key-file PATH] [--cluster-secret S | --cluster-secret-file PATH]

Every flag is parsed and checked here, once; the rest of the router takes a ``RouterConfig`` (or
its own slice of it) and never reads ``argv`` or the environment (the two secrets fall back to
``PDC_API_KEY`` / ``PDC_CLUSTER_SECRET`` here, through ``common.envs``).
"""
from __future__ import annotations

import argparse
import fnmatch
import ipaddress
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common import envs
from common.auth import SecretError, is_loopback, resolve_secret
from common.http_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_N, ROUTER_MAX_BODY_BYTES

POLICIES = ("least-loaded", "cache-aware", "power-of-two", "round-robin", "random")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    url: str  # base URL, no trailing slash
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None  # prefill only; None: the node's default


@dataclass(frozen=True)
class CacheAwareConfig:
    threshold: float = 0.5  # matched share of a prompt at which its prefix owner gets it
    balance_abs_threshold: int = 32  # ... unless it has this many more requests than the least loaded
    max_tree_chars: int = 2_000_000  # prompt characters remembered in all (LRU eviction)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[WorkerSpec, ...] = ()
    prefill_policy: str = "least-loaded"
    decode_policy: str = "least-loaded"
    request_timeout_s: float = 600.0  # one client request, retries included
    max_retries: int = 2  # tries after the first, while no byte reached the client
    retry_budget_s: float = 30.0  # no new try starts later than this after the request arrived
    health_check_interval_s: float = 1.0
    health_failure_threshold: int = 2  # failed probes in a row before a worker leaves rotation
    health_check_timeout_s: float = 2.0
    load_poll_interval_s: float = 1.0
    cache: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    log_level: str = "info"
    # Clients must send "Authorization: Bearer <api_key>" (None: open). repr=False: never logged.
    api_key: str | None = field(default=None, repr=False)
    # The operator endpoints (router/auth.py) need "Authorization: Bearer <operator_key>".
    operator_key: str | None = field(default=None, repr=False)
    # Request tokens made from it go to the nodes (router/node_auth.py); never sent itself.
    cluster_secret: str | None = field(default=None, repr=False)
    # Hosts POST /workers may add ("host", "host:port", "*.suffix", "10.0.0.0/8"; () = any); the
    # command line's workers are allowed whatever it says.
    worker_allow: tuple[str, ...] = ()
    keys_file: str | None = None  # per-client keys, roles and limits (router/clients.py); SIGHUP reloads
    # TLS for clients (None: plain HTTP). The key may sit in the certificate file.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # TLS towards https:// workers: the CAs their certificates are checked against (None: the
    # system's) and the client certificate shown to nodes that require one (mutual TLS).
    worker_ssl_ca_certs: str | None = None
    worker_ssl_certfile: str | None = None
    worker_ssl_keyfile: str | None = None
    # Client input limits (common/http_limits.py): a larger body is a 413 before it is read; a
    # request head (body) not in within the timeout closes the connection (is a 408).
    max_payload_size: int = ROUTER_MAX_BODY_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_n: int = MAX_N  # samples (OpenAI n) per prompt; more is a 400 here, before any node sees it
    # The model's tokenizer.json (or its directory): with it, cache-aware routes on token blocks
    # and the nodes' KV events (router/kv_subscriber.py); without, on the character tree.
    tokenizer_path: str | None = None
    kv_events_stale_s: float = 3.0  # a KV-event subscription silent this long is lost (heartbeats: 1 s)
    # With exact cache-aware decode routing: a request whose chosen decode would have at most this
    # many prompt tokens to compute past its cached prefix goes to that decode alone (0: never).
    decode_local_prefill_tokens: int = 0


    def worker_allowed(self, url: str) -> bool:
        """Whether ``POST /workers`` may add ``url`` (``worker_allow``; any with an empty list)."""
        if not self.worker_allow or any(w.url == url for w in self.workers):
            return True
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port
        for pattern in self.worker_allow:
            p_host, _, p_port = pattern.lower().rpartition(":") if _has_port(pattern) else (pattern.lower(), "", "")
            if p_port and p_port != "*" and str(port) != p_port:
                continue
            if "/" in p_host:
                try:
                    if ipaddress.ip_address(host) in ipaddress.ip_network(p_host, strict=False):
                        return True
                except ValueError:
                    continue
            elif fnmatch.fnmatchcase(host, p_host.strip("[]")):
                return True
        return False


def _has_port(pattern: str) -> bool:
    """``host:port`` (or ``[v6]:port``), not a bare IPv6 address or CIDR."""
    if pattern.startswith("["):
        return "]:" in pattern
    return pattern.count(":") == 1


class ConfigError(ValueError):
    """A flag value the router cannot run with; the message names the flag."""


def check_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what}: {url!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError as exc:
        raise ConfigError(f"{what}: {url!r} has a bad port") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{what}: {url!r} must be a base URL (no path, query or fragment)")
    return url.rstrip("/")


def check_bootstrap_port(value: object, what: str) -> int | None:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
        return None
    try:
        port = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: bootstrap port {value!r} is not a number") from exc
    if isinstance(value, bool) or not 0 < port < 65536:
        raise ConfigError(f"{what}: bootstrap port {value!r} is not in 1..65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdcluster router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                    help="a prefill node and, optionally, its bootstrap port (repeat per node)")
    ap.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL",
                    help="a decode node (repeat per node)")
    ap.add_argument("--pd-disaggregation", action="store_true", help="accepted for sglang-router compatibility")
    ap.add_argument("--policy", choices=POLICIES, default="least-loaded", help="for both roles")
    ap.add_argument("--prefill-policy", choices=POLICIES, help="overrides --policy for prefill nodes")
    ap.add_argument("--decode-policy", choices=POLICIES, help="overrides --policy for decode nodes")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--max-retries", type=int, default=2)
    ap.add_argument("--retry-budget-s", type=float, default=30.0)
    ap.add_argument("--health-check-interval-s", type=float, default=1.0)
    ap.add_argument("--health-failure-threshold", type=int, default=2)
    ap.add_argument("--health-check-timeout-s", type=float, default=2.0)
    ap.add_argument("--load-poll-interval-s", type=float, default=1.0)
    ap.add_argument("--cache-threshold", type=float, default=0.5)
    ap.add_argument("--balance-abs-threshold", type=int, default=32)
    ap.add_argument("--max-tree-chars", type=int, default=2_000_000)
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (default: PDC_API_KEY; "
                    "none: open). A flag shows in `ps`: prefer the variable or --api-key-file")
    ap.add_argument("--api-key-file", metavar="PATH", help="read the API key from this file (a mounted Secret)")
    ap.add_argument("--operator-key", help="the operator endpoints (add or drain workers, /flush_cache, "
                    "/abort_request) need 'Authorization: Bearer KEY' (default: PDC_OPERATOR_KEY; none: they are "
                    "open only if --api-key is unset too)")
    ap.add_argument("--operator-key-file", metavar="PATH", help="read the operator key from this file")
    ap.add_argument("--keys-file", metavar="PATH", help="per-client keys, roles, rate limits and endpoints (JSON; "
                    "see router/clients.py and docs/OPERATIONS.md); reloaded on SIGHUP")
    ap.add_argument("--ssl-certfile", metavar="PATH", help="serve HTTPS with this certificate (chain) in PEM")
    ap.add_argument("--ssl-keyfile", metavar="PATH", help="its private key in PEM (default: inside --ssl-certfile)")
    ap.add_argument("--worker-ssl-ca-certs", metavar="PATH",
                    help="check https:// workers' certificates against these CAs (default: the system's)")
    ap.add_argument("--worker-ssl-certfile", metavar="PATH",
                    help="client certificate (PEM) for https:// workers that require one (their --ssl-ca-certs)")
    ap.add_argument("--worker-ssl-keyfile", metavar="PATH", help="its private key (default: inside --worker-ssl-certfile)")
    ap.add_argument("--insecure", action="store_true",
                    help="listen on a non-loopback --host with neither --api-key nor --operator-key")
    ap.add_argument("--worker-allow", action="append", default=[], metavar="PATTERN",
                    help="hosts POST /workers may add: host, host:port, *.suffix, or a CIDR; repeatable "
                         "(default: any host; the command line's workers are always allowed)")
    ap.add_argument("--cluster-secret", help="request tokens made from it go to the nodes; it is never sent "
                    "(default: PDC_CLUSTER_SECRET; none: nothing sent)")
    ap.add_argument("--cluster-secret-file", metavar="PATH", help="read the cluster secret from this file")
    ap.add_argument("--max-payload-size", type=int, default=ROUTER_MAX_BODY_BYTES, metavar="BYTES",
                    help="largest request body; a larger one is a 413 before it is read (default: %(default)s)")
    ap.add_argument("--header-timeout-s", type=float, default=HEADER_TIMEOUT_S,
                    help="a connection whose request head has not arrived this long after it opened (or after "
                         "its last response: idle keep-alive too) is closed (default: %(default)s)")
    ap.add_argument("--body-timeout-s", type=float, default=BODY_TIMEOUT_S,
                    help="a request body not in this long after its head is a 408 (default: %(default)s)")
    ap.add_argument("--max-n", type=int, default=MAX_N, help="most samples (n) per prompt (default: %(default)s)")
    ap.add_argument("--tokenizer-path", metavar="PATH", help="the model's tokenizer.json or its directory: "
                    "cache-aware then predicts each worker's cache hit exactly from its KV events (the prefills', and "
                    "the decodes' for a cache-aware decode policy; without: a character prefix tree of the prompts "
                    "it routed)")
    ap.add_argument("--kv-events-stale-s", type=float, default=3.0, help="a node's KV-event subscription "
                    "silent this long is lost; that node is routed by load until resynced (default: %(default)s)")
    ap.add_argument("--decode-local-prefill-tokens", type=int, default=0, metavar="N",
                    help="with --decode-policy cache-aware and --tokenizer-path: a single-sequence request whose "
                         "chosen decode holds all but at most N of its prompt's tokens in its prefix cache (a "
                         "conversation's next turn) goes to that decode alone, which computes the rest itself: no "
                         "prefill, no KV transfer. That decode's running streams wait for the extend (at most N tokens) "
                         "(default: %(default)s, off)")
    return ap


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    workers: list[WorkerSpec] = []
    for entry in ns.prefill:
        if len(entry) > 2:
            raise ConfigError(f"--prefill takes a URL and at most one bootstrap port, got {entry}")
        url = check_url(entry[0], "--prefill")
        workers.append(WorkerSpec(url, "prefill", check_bootstrap_port(entry[1] if len(entry) > 1 else None,
                                                                       f"--prefill {url}")))
    workers += [WorkerSpec(check_url(d[0], "--decode"), "decode") for d in ns.decode]
    urls = [w.url for w in workers]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"a worker is listed twice: {sorted(u for u in urls if urls.count(u) > 1)}")
    positive = {"--request-timeout-s": ns.request_timeout_s, "--retry-budget-s": ns.retry_budget_s,
                "--health-check-interval-s": ns.health_check_interval_s,
                "--health-check-timeout-s": ns.health_check_timeout_s,
                "--load-poll-interval-s": ns.load_poll_interval_s, "--health-failure-threshold": ns.health_failure_threshold,
                "--max-tree-chars": ns.max_tree_chars, "--max-payload-size": ns.max_payload_size,
                "--header-timeout-s": ns.header_timeout_s, "--body-timeout-s": ns.body_timeout_s, "--max-n": ns.max_n,
                "--kv-events-stale-s": ns.kv_events_stale_s}
    for flag, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if ns.max_retries < 0 or ns.balance_abs_threshold < 0 or ns.decode_local_prefill_tokens < 0:
        raise ConfigError("--max-retries, --balance-abs-threshold and --decode-local-prefill-tokens must be >= 0")
    if not 0.0 <= ns.cache_threshold <= 1.0:
        raise ConfigError(f"--cache-threshold must be in [0, 1], got {ns.cache_threshold}")
    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port {ns.port} is not a port number")
    try:
        api_key = resolve_secret(ns.api_key, ns.api_key_file, envs.API_KEY, "--api-key")
        operator_key = resolve_secret(ns.operator_key, ns.operator_key_file, envs.OPERATOR_KEY, "--operator-key")
        cluster_secret = resolve_secret(ns.cluster_secret, ns.cluster_secret_file, envs.CLUSTER_SECRET,
                                        "--cluster-secret")
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc
    if api_key is None and operator_key is None and ns.keys_file is None and not is_loopback(ns.host) and not ns.insecure:
        raise ConfigError(f"--host {ns.host} is reachable from other machines and this router has no key: anyone "
                          "could generate, add workers or abort every stream. Set PDC_API_KEY and "
                          "PDC_OPERATOR_KEY (or their flags), or pass --insecure to run open anyway")
    if ns.ssl_keyfile is not None and ns.ssl_certfile is None:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    if ns.worker_ssl_keyfile is not None and ns.worker_ssl_certfile is None:
        raise ConfigError("--worker-ssl-keyfile needs --worker-ssl-certfile")
    if api_key is not None and api_key == operator_key:
        raise ConfigError("--operator-key must differ from --api-key: a client key must not be an operator's")
    for pattern in ns.worker_allow:
        if not pattern or any(c.isspace() for c in pattern):
            raise ConfigError(f"--worker-allow {pattern!r}: expected host, host:port, *.suffix or a CIDR")
    tokenizer_path = ns.tokenizer_path
    if tokenizer_path is not None:
        file = tokenizer_path if os.path.isfile(tokenizer_path) else os.path.join(tokenizer_path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ConfigError(f"--tokenizer-path {tokenizer_path}: no tokenizer.json there")
    return RouterConfig(
        host=ns.host, port=ns.port, workers=tuple(workers),
        prefill_policy=ns.prefill_policy or ns.policy, decode_policy=ns.decode_policy or ns.policy,
        request_timeout_s=ns.request_timeout_s, max_retries=ns.max_retries, retry_budget_s=ns.retry_budget_s,
        health_check_interval_s=ns.health_check_interval_s, health_failure_threshold=ns.health_failure_threshold,
        health_check_timeout_s=ns.health_check_timeout_s, load_poll_interval_s=ns.load_poll_interval_s,
        cache=CacheAwareConfig(ns.cache_threshold, ns.balance_abs_threshold, ns.max_tree_chars),
        log_level=ns.log_level, api_key=api_key, operator_key=operator_key, worker_allow=tuple(ns.worker_allow),
        cluster_secret=cluster_secret, ssl_certfile=ns.ssl_certfile, ssl_keyfile=ns.ssl_keyfile, keys_file=ns.keys_file,
        worker_ssl_ca_certs=ns.worker_ssl_ca_certs, worker_ssl_certfile=ns.worker_ssl_certfile,
        worker_ssl_keyfile=ns.worker_ssl_keyfile,
        max_payload_size=ns.max_payload_size, header_timeout_s=ns.header_timeout_s, body_timeout_s=ns.body_timeout_s,
        max_n=ns.max_n, tokenizer_path=tokenizer_path, kv_events_stale_s=ns.kv_events_stale_s,
        decode_local_prefill_tokens=ns.decode_local_prefill_tokens)


def parse_config(argv: list[str]) -> RouterConfig:
    """The configuration of ``argv``; ``SystemExit(2)`` with argparse's message on a bad flag,
    ``ConfigError`` on a bad value."""
    return config_from_args(build_parser().parse_args(argv))
