"""Start a prefill + decode pair on this machine (``pdcluster up``, ``pdcluster bench --launch``);
stop it by PID.

Each node runs in its own session, so ``stop()`` signals the whole process group (API process,
scheduler, mooncake threads) — SIGTERM, then SIGKILL after a grace period. With a ``logdir`` node
output goes to log files (their tails are shown when a node fails to start); without, it goes to
this process's terminal.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import IO

from common.tools.bench_client import Target

STOP_GRACE_S = 15.0
# The directory holding the ``common`` package: children import ``prefill_node`` / ``decode_node``
# from there whatever the bench's working directory (the repo is not necessarily installed).
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


@dataclass
class LaunchedPair:
    """Use as ``pair = LaunchedPair(); try: pair.start(...) ... finally: pair.stop()``: processes
    are recorded as they start, so a start-up failure leaves nothing running."""

    logdir: str | None = None  # None: node output goes to our stdout/stderr
    target: Target | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    def start(self, model_path: str, backend: str, page_size: int, prefill_args: list[str],
              decode_args: list[str], startup_timeout_s: float) -> Target:
        """Start both nodes; return once both answer ``/health`` (raises on exit or timeout)."""
        p_port, d_port, b_port = free_port(), free_port(), free_port()
        self.target = Target(f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", "127.0.0.1", b_port)
        env = dict(os.environ)
        env.setdefault("PDC_LOG_LEVEL", "WARNING")
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_CODE_ROOT, env.get("PYTHONPATH")) if p)
        common = ["--model-path", model_path, "--host", "127.0.0.1", "--page-size", str(page_size),
                  "--disaggregation-transfer-backend", backend, "--disaggregation-bootstrap-port", str(b_port)]
        for role, port, extra in (("prefill", p_port, prefill_args), ("decode", d_port, decode_args)):
            log: IO[str] | None = None
            if self.logdir is not None:
                log_path = os.path.join(self.logdir, f"{role}.log")
                self.logs.append(log_path)
                log = open(log_path, "w")
            try:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", f"{role}_node", *common, "--port", str(port), *extra], env=env,
                    stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True))
            finally:
                if log is not None:
                    log.close()  # the child has its own copy of the descriptor
        wait_healthy(self.target.prefill, self.procs[0], startup_timeout_s)
        wait_healthy(self.target.decode, self.procs[1], startup_timeout_s)
        return self.target

    def cpu_seconds(self) -> dict[str, float] | None:
        """User + system CPU seconds used so far by each node's live processes, split into its API
        process (the group leader: uvicorn, tokenize, stream) and the rest of its group (the
        scheduler process, plus multiprocessing's small helpers); None without /proc (not Linux)."""
        if not os.path.isdir("/proc") or len(self.procs) != 2:
            return None
        groups = {self.procs[0].pid: "prefill", self.procs[1].pid: "decode"}
        out = {f"{role}_{part}": 0.0 for role in groups.values() for part in ("api", "scheduler")}
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
            if pgrp in groups:
                part = "api" if int(entry) == pgrp else "scheduler"
                out[f"{groups[pgrp]}_{part}"] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return out

    def log_tails(self, n: int = 30) -> str:
        out = []
        for path in self.logs:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                out.append(f"---- {path}\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
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
