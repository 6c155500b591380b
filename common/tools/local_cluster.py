"""Start a whole cluster on this machine — N prefill nodes, M decode nodes and a router in front —
for ``pdcluster up`` and ``pdcluster bench --launch``; stop it by PID.

    nodes (all at once, free loopback ports) -> each answers /health
      -> router (ours: ``python -m router``; or sglang-router from its own venv; or none)
      -> the router sees every worker healthy -> ``url`` is the front door

Each process runs in its own session, so ``stop()`` signals the whole process group (API process,
scheduler, mooncake threads) — SIGTERM, then SIGKILL after a grace period. With a ``logdir``
output goes to one log file per process (their tails are shown when one fails to start); without,
it goes to this process's terminal. Processes are recorded as they start, so a start-up failure
followed by ``stop()`` leaves nothing running.

Access control (off unless given; ``pdcluster up`` gives both secrets): ``cluster_secret`` reaches
every node and the router as ``PDC_CLUSTER_SECRET`` in their environment (not argv, which ``ps``
shows), ``api_key`` and ``operator_key`` the router as ``PDC_API_KEY`` / ``PDC_OPERATOR_KEY``.
sglang-router has one key for clients and workers (``--api-key``), so with it both must be the
same, and the nodes then accept the bare secret (``PDC_ACCEPT_BEARER_SECRET``). ``headers()`` is
what a client of the router sends; ``node_headers(method, url, body)`` what one request straight
to a node or registry carries (a request token).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

from common import envs
from common.auth import bearer, signed_headers
from common.config import node_device
from common.cpu_budget import split_threads
from common.ports import free_port

STOP_GRACE_S = 15.0
ROUTERS = ("ours", "sglang", "none")
# The directory holding the ``common`` package: children import ``prefill_node`` / ``router``
# from there whatever the caller's working directory (the repo is not necessarily installed).
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SGLANG_ROUTER_PYTHON = os.path.join(CODE_ROOT, ".venv-router", "bin", "python")


def _per_node(tp: int | Sequence[int], count: int, what: str) -> list[int]:
    tps = [tp] * count if isinstance(tp, int) else list(tp)
    if len(tps) != count or any(t < 1 for t in tps):
        raise ValueError(f"{what}: one TP size >= 1 for each of the {count} nodes, got {tp!r}")
    return tps


def _on_gpu(args: Sequence[str], env: dict[str, str]) -> bool:
    """Whether a node started with ``args`` and ``env`` runs on a GPU, as the node decides it."""
    device = "auto"
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif a.startswith("--device="):
            device = a.partition("=")[2]
    return node_device(device, env.get("PDC_DEVICE", "auto")).startswith("cuda")


def budget_args(prefill_args: Sequence[str], decode_args: Sequence[str], prefill_tps: list[int], decode_tps: list[int],
                env: dict[str, str], share_group: str) -> tuple[list[list[str]], list[list[str]]]:
    """Each prefill's and each decode's --tp-size and CPU budget flags. The nodes share this host's
    cores: each scheduler rank gets its share of torch threads (a node divides its --cpu-threads
    among its TP ranks), unless the caller chose (a flag, or PDC_CPU_THREADS in ``env``). Nodes
    given a share also share it back: a decode step borrows what an idle prefill lends
    (common/cpu_share.py), one ``share_group`` per cluster so two clusters never mix. A GPU node
    takes no share: its default is one thread (common/cpu_budget.py, GPU_NODE_THREADS), and the
    CPU nodes split the cores among themselves, with no one to share with across the roles."""
    prefill_gpu, decode_gpu = _on_gpu(prefill_args, env), _on_gpu(decode_args, env)
    cpu_ranks = (0 if prefill_gpu else sum(prefill_tps)) + (0 if decode_gpu else sum(decode_tps))
    chosen = any(a.startswith("--cpu-threads") for a in (*prefill_args, *decode_args)) or "PDC_CPU_THREADS" in env
    per_rank = split_threads(cpu_ranks) if cpu_ranks and not chosen else 0  # 0: no share given
    share = [] if not per_rank or prefill_gpu or decode_gpu or "PDC_CPU_SHARE" in env \
        or any(a.startswith("--cpu-share") for a in (*prefill_args, *decode_args)) else ["--cpu-share", share_group]

    def own(tp: int, gpu: bool) -> list[str]:
        if gpu or not per_rank:
            return ["--tp-size", str(tp)]
        return ["--tp-size", str(tp), "--cpu-threads", str(per_rank * tp), *share]

    return [own(tp, prefill_gpu) for tp in prefill_tps], [own(tp, decode_gpu) for tp in decode_tps]


def get_json(url: str, timeout_s: float = 10, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as r:
        return json.loads(r.read())


def _get_status(url: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
    """(HTTP status, JSON body or None); (0, None) when nothing answered."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass(frozen=True)
class NodeInfo:
    name: str  # "prefill0", "decode1": also the key of its process and log
    role: str  # "prefill" | "decode"
    url: str  # base URL, no trailing slash
    bootstrap_port: int | None = None  # prefill only


@dataclass
class LocalCluster:
    """Use as ``c = LocalCluster(); try: c.start(...) ... finally: c.stop()``."""

    logdir: str | None = None  # None: output goes to our stdout/stderr
    env: dict[str, str] = field(default_factory=dict)  # on top of ours, for every child
    nodes: list[NodeInfo] = field(default_factory=list)
    router_url: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> process (group leader)
    logs: list[str] = field(default_factory=list)
    argv: dict[str, list[str]] = field(default_factory=dict)  # name -> command line, for restart()
    # None: open to anyone. The defaults are what the children would inherit from our environment.
    cluster_secret: str | None = field(default_factory=lambda: envs.CLUSTER_SECRET.get() or None, repr=False)
    api_key: str | None = field(default_factory=lambda: envs.API_KEY.get() or None, repr=False)
    operator_key: str | None = field(default_factory=lambda: envs.OPERATOR_KEY.get() or None, repr=False)
    _router_kind: str = field(default="ours", init=False, repr=False)

    def headers(self) -> dict[str, str]:
        """What a client sends to the router."""
        return bearer(self.api_key or (self.cluster_secret if self._router_kind == "sglang" else None))

    def node_headers(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """What one request straight to a node or registry carries: a request token made from the
        cluster secret for exactly this request (common/auth.py), none without a secret."""
        return signed_headers(self.cluster_secret, method, url, body)

    @property
    def prefills(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.role == "prefill"]

    @property
    def decodes(self) -> list[NodeInfo]:
        return [n for n in self.nodes if n.role == "decode"]

    def start(self, model_path: str, *, backend: str = "mooncake", page_size: int = 16, num_prefill: int = 1,
              num_decode: int = 1, prefill_args: list[str] = (), decode_args: list[str] = (),  # type: ignore[assignment]
              prefill_tp: int | Sequence[int] = 1, decode_tp: int | Sequence[int] = 1, router: str = "ours", router_args: list[str] = (), router_port: int | None = None,  # type: ignore[assignment]
              router_host: str = "127.0.0.1", startup_timeout_s: float = 180.0) -> str | None:
        """Start the nodes, then the router; return the router's URL (None with ``router="none"``)
        once it sees every node healthy. Raises RuntimeError/TimeoutError on a failed start.
        ``prefill_tp``/``decode_tp``: every node's ``--tp-size``, or one per node."""
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, not {router!r}")
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        prefill_tps = _per_node(prefill_tp, num_prefill, "prefill_tp")
        decode_tps = _per_node(decode_tp, num_decode, "decode_tp")
        if router == "sglang" and self.api_key and self.cluster_secret and self.api_key != self.cluster_secret:
            raise ValueError("sglang-router sends its one --api-key to the workers too: with a cluster secret, "
                             "the API key must be the same or unset")
        self._router_kind = router
        common = ["--model-path", model_path, "--host", "127.0.0.1", "--page-size", str(page_size),
                  "--disaggregation-transfer-backend", backend]
        prefill_own, decode_own = budget_args(prefill_args, decode_args, prefill_tps, decode_tps,
                                              {**os.environ, **self.env}, f"cluster-{os.getpid()}-{id(self):x}")
        for i, own in enumerate(prefill_own):
            port, bport = free_port(), free_port()
            self._start_node(NodeInfo(f"prefill{i}", "prefill", f"http://127.0.0.1:{port}", bport),
                             [*common, *own, "--port", str(port), "--disaggregation-bootstrap-port",
                              str(bport), *prefill_args])
        for i, own in enumerate(decode_own):
            port = free_port()
            self._start_node(NodeInfo(f"decode{i}", "decode", f"http://127.0.0.1:{port}"),
                             [*common, *own, "--port", str(port), *decode_args])
        deadline = time.monotonic() + startup_timeout_s
        for node in self.nodes:
            self._wait(node.name, lambda n=node: _get_status(n.url + "/health")[0] == 200, deadline)
        if router == "none":
            return None
        port = router_port or free_port()
        self.router_url = f"http://{'127.0.0.1' if router_host in ('0.0.0.0', '::') else router_host}:{port}"
        if router == "ours":
            self._spawn("router", [sys.executable, "-m", "router", *self._router_argv(router_host, port),
                                   "--log-level", "warning", *router_args])
            self._wait("router", self._all_workers_healthy, deadline)
        else:
            key = self.api_key or self.cluster_secret  # sglang-router takes no variable for it
            self._spawn("router", [SGLANG_ROUTER_PYTHON, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                   *self._router_argv(router_host, port), *(["--api-key", key] if key else []),
                                   # its metrics port defaults to a fixed 29000 that two runs would fight over
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                   "--shutdown-grace-period-secs", "1", "--log-level", "warn", *router_args])
            self._wait("router", self._sglang_ready, deadline)
        return self.router_url

    # ---- start-up ------------------------------------------------------------------------------

    def _router_argv(self, host: str, port: int, nodes: Sequence[NodeInfo] | None = None) -> list[str]:
        argv = ["--host", host, "--port", str(port)]
        nodes = self.nodes if nodes is None else nodes
        for n in nodes:
            argv += ["--prefill", n.url, str(n.bootstrap_port)] if n.role == "prefill" else ["--decode", n.url]
        return argv

    def start_router(self, name: str, nodes: Sequence[str], args: Sequence[str] = (), timeout_s: float = 60.0) -> str:
        """Another router of ours, in front of only the named nodes (e.g. one prefill/decode pair);
        stopped with the cluster. Returns its URL once it sees them all healthy."""
        chosen = [n for n in self.nodes if n.name in nodes]
        if len(chosen) != len(nodes):
            raise ValueError(f"unknown nodes in {list(nodes)}")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self._spawn(name, [sys.executable, "-m", "router", *self._router_argv("127.0.0.1", port, chosen),
                           "--log-level", "warning", *args])

        def healthy() -> bool:
            status, body = _get_status(f"{url}/workers", self.headers())
            workers = body.get("workers", []) if status == 200 and isinstance(body, dict) else []
            return len(workers) == len(chosen) and all(w.get("healthy") for w in workers)

        self._wait(name, healthy, time.monotonic() + timeout_s)
        return url

    def _all_workers_healthy(self) -> bool:
        status, body = _get_status(f"{self.router_url}/workers", self.headers())
        if status != 200 or not isinstance(body, dict):
            return False
        workers = body.get("workers", [])
        return len(workers) == len(self.nodes) and all(w.get("healthy") for w in workers)

    def _sglang_ready(self) -> bool:
        status, body = _get_status(f"{self.router_url}/readiness", self.headers())
        return status == 200 and isinstance(body, dict) and body.get("healthy_workers") == len(self.nodes)

    def spawn(self, name: str, argv: list[str], health_url: str, timeout_s: float) -> None:
        """Start some other server (a peer engine, for comparison) as part of this cluster:
        stopped with it, its CPU time counted; return once ``health_url`` answers 200."""
        self._spawn(name, argv)
        self._wait(name, lambda: _get_status(health_url)[0] == 200, time.monotonic() + timeout_s)

    def _start_node(self, node: NodeInfo, args: list[str]) -> None:
        self.nodes.append(node)
        self._spawn(node.name, [sys.executable, "-m", f"{node.role}_node", *args])

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = {"PDC_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR", **os.environ, **self.env}
        if self.cluster_secret:
            env["PDC_CLUSTER_SECRET"] = self.cluster_secret
            if self._router_kind == "sglang":  # it can only send the bare secret (its --api-key)
                env["PDC_ACCEPT_BEARER_SECRET"] = "1"
        if self.api_key and name == "router":
            env["PDC_API_KEY"] = self.api_key
        if self.operator_key and name == "router":
            env["PDC_OPERATOR_KEY"] = self.operator_key
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_ROOT, env.get("PYTHONPATH")) if p)
        self.argv[name] = argv
        log: IO[str] | None = None
        if self.logdir is not None:
            path = os.path.join(self.logdir, f"{name}.log")
            if path not in self.logs:
                self.logs.append(path)
            log = open(path, "a")
        try:
            self.procs[name] = subprocess.Popen(argv, env=env, cwd=CODE_ROOT, stdout=log,
                                                stderr=subprocess.STDOUT if log else None, start_new_session=True)
        finally:
            if log is not None:
                log.close()  # the child has its own copy of the descriptor

    def _wait(self, name: str, ready: Callable[[], bool], deadline: float) -> None:
        proc = self.procs[name]
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: exited with code {proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not ready before the start-up timeout")
            time.sleep(0.2)

    # ---- while running ---------------------------------------------------------------------------

    def dead(self) -> list[str]:
        """Names of processes that have exited."""
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def cpu_seconds(self) -> dict[str, float] | None:
        """User + system CPU seconds used so far by each live process group: a node splits into its
        API process (the group leader: uvicorn, tokenize, stream) and the rest of its group (the
        scheduler process and multiprocessing's helpers); the router or a peer is one entry. None without
        /proc (not Linux)."""
        if not os.path.isdir("/proc") or not self.procs:
            return None
        groups = {p.pid: name for name, p in self.procs.items()}
        nodes = {n.name for n in self.nodes}
        out = {name: 0.0 for name in groups.values() if name not in nodes}  # router, peers: one entry
        out.update({f"{n}_{part}": 0.0 for n in nodes for part in ("api", "scheduler")})
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
            except OSError:
                continue  # exited meanwhile
            pgrp = int(fields[2])
            if pgrp not in groups:
                continue
            name = groups[pgrp]
            key = name if name not in nodes else f"{name}_{'api' if int(entry) == pgrp else 'scheduler'}"
            out[key] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return out

    def log_tails(self, n: int = 30) -> str:
        out = []
        for path in self.logs:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                out.append(f"---- {path}\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process group (a test's fault injection); SIGKILL also reaps it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=10)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a stopped node again on its old ports; return once it answers ``/health``."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        node = next(n for n in self.nodes if n.name == name)
        self._spawn(name, self.argv[name])
        self._wait(name, lambda: _get_status(node.url + "/health")[0] == 200, time.monotonic() + timeout_s)

    def stop(self) -> None:
        """The router first (no new requests reach dying nodes), then every node at once."""
        order = [p for _, p in sorted(self.procs.items(), key=lambda kv: not kv[0].startswith("router"))]
        for p in order:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in order:
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            # Children of the group outlive a leader that exited on SIGTERM only if they hang:
            # SIGKILL whatever is left of the group either way.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
