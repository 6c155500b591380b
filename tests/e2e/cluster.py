"""Whole-node helpers: prefill + decode node processes on free loopback ports, driven like sglang-router.

    with running_cluster(model_dir, backend="mooncake", decode_args=[...], prefill_args=[...], env={...}) as c:
    c.pd(path, body) -> (prefill response, decode response)     both nodes at once, one room, like sglang-router
    c.pd_stream(path, body, on_event) -> (prefill response, decode SSE events, decode status)
    c.start_prefill() -> (extra prefill node, its bootstrap port)  killed with the cluster
    c.wait_idle() / wait_idle(url)                            /debug/memory back at idle (bounded) or fail
    check_greedy(model_dir, prompt, output_ids, n, what)      HF greedy equality with the near-tie rule
    check_greedy_text(model_dir, decode, prompt, text, n, what)  the same for an OpenAI answer's text

Every process is started in its own session and killed by process group in a ``finally`` (SIGTERM,
then SIGKILL), so a failing test leaves nothing behind. Start-up waits for ``/health`` with a bound
and fails at once, with the node's log tail, if a process exits.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from common.auth import signed_headers
from common.ports import free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NEAR_TIE = 1e-3  # a top-2 logit gap below this is a tie float noise may break either way
# The tool call the session's scripted checkpoint writes (conftest's scripted_routed), one added
# token per chunk (tests/e2e/test_tool_call_auto.py).
TOOL_CALL_SCRIPT = ("<tool_call>\n", '{"name": ', '"get_time"', ', "arguments": ', '{"tz": ', '"CET"', "}}",
                    "\n</tool_call>")
STARTUP_TIMEOUT_S = 120.0
# Decode flags for a pool that must run dry: 16 pages of 16 tokens and an optimistic headroom
# ratio, so concurrent long outputs are retracted.
SMALL_POOL = ["--max-total-tokens", "256", "--num-reserved-decode-tokens", "16", "--max-running-requests", "8",
              "--schedule-conservativeness", "0.1"]
IDLE_TIMEOUT_S = 20.0
_rooms = itertools.count(random.randrange(1, 2**40))


def next_room() -> int:
    return next(_rooms)


@dataclass
class Node:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""

    def kill(self, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> None:
        """Stop the node and every process it started (its own session = process group)."""
        self.signal_group(sig)
        self.reap(grace_s)

    def signal_group(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def reap(self, grace_s: float = 15.0) -> None:
        """Wait (bounded) for a signalled node to exit, then SIGKILL whatever is left of its group."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def start_node(role: str, model_dir: str, args: list[str], env: dict[str, str] | None, logdir: str) -> Node:
    port = free_port()
    log_path = os.path.join(logdir, f"{role}-{port}.log")
    full_env = {**os.environ, "PDC_LOG_LEVEL": "WARNING", "MC_LOG_LEVEL": "ERROR", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"{role}_node", "--model-path", model_dir, "--host", "127.0.0.1",
             "--port", str(port), *args],
            cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Node(role, f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(nodes: list[Node], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(nodes)
    while pending:
        for n in list(pending):
            if n.proc.poll() is not None:
                raise RuntimeError(f"{n.name} node exited with {n.proc.returncode} during start-up:\n{n.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(n.url + "/health", timeout=2).status_code == 200:
                    pending.remove(n)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{[n.name for n in pending]} not healthy within {timeout_s:g} s:\n"
                               + "\n".join(n.log_tail() for n in pending))
        if pending:
            time.sleep(0.3)


def memory(url: str, secret: str | None = None) -> dict:
    r = httpx.get(url + "/debug/memory", timeout=10, headers=signed_headers(secret, "GET", url + "/debug/memory"))
    r.raise_for_status()
    return r.json()


def metric(url: str, name: str) -> float:
    """One sample of a node's /metrics (the first series of ``name``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def is_idle(mem: dict) -> bool:
    """Nothing held: pages free or merely cached (unlocked), every row, aux and state slot back, no room."""
    ok = (mem["free_pages"] + mem.get("evictable_pages", 0) == mem["total_pages"]
          and mem.get("locked_pages", 0) == 0 and mem["free_req_slots"] == mem["total_req_slots"]
          and mem.get("transfer_rooms", 0) == 0 and mem.get("integrity", "ok") == "ok")
    if "aux_total_slots" in mem:
        ok = ok and mem["aux_free_slots"] == mem["aux_total_slots"]
    if "total_state_slots" in mem:  # hybrid models
        ok = ok and mem["free_state_slots"] == mem["total_state_slots"]
    return ok


def wait_idle(url: str, timeout_s: float = IDLE_TIMEOUT_S, secret: str | None = None) -> dict:
    """Poll /debug/memory until the node holds nothing (bounded); returns the last report.
    ``secret``: the cluster secret, for a node that requires it (each poll gets its own token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        mem = memory(url, secret)
        if is_idle(mem):
            return mem
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not return to idle within {timeout_s:g} s: {mem}")
        time.sleep(0.1)


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    bootstrap_port: int
    model_dir: str
    extra_nodes: list[Node] = field(default_factory=list)
    common_args: list[str] = field(default_factory=list)  # backend and page size, for extra nodes

    def body(self, body: dict, room: int | None = None, bootstrap_port: int | None = None) -> dict:
        """``body`` plus the bootstrap fields sglang-router adds."""
        return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port or self.bootstrap_port,
                "bootstrap_room": next_room() if room is None else room}

    def pd(self, path: str, body: dict, timeout_s: float = 60.0, prefill_url: str | None = None,
           bootstrap_port: int | None = None) -> tuple[httpx.Response, httpx.Response]:
        """POST the same body (with one room) to a prefill and the decode node at once."""
        b = self.body(body, bootstrap_port=bootstrap_port)
        pb = {**b, "stream": True}  # the router asks the prefill for a stream
        with ThreadPoolExecutor(2) as ex:
            p = ex.submit(httpx.post, (prefill_url or self.prefill.url) + path, json=pb, timeout=timeout_s)
            d = ex.submit(httpx.post, self.decode.url + path, json=b, timeout=timeout_s)
            return p.result(), d.result()

    def pd_stream(self, path: str, body: dict, timeout_s: float = 60.0,
                  on_event: Callable[[dict], bool] | None = None) -> tuple[httpx.Response, list[dict], int]:
        """Stream the decode answer; ``on_event`` returning False closes the stream early (a client
        disconnect). Returns (prefill response, decode events, decode status)."""
        b = self.body({**body, "stream": True})
        events: list[dict] = []
        status = [0]

        def run_decode() -> None:
            with httpx.stream("POST", self.decode.url + path, json=b, timeout=timeout_s) as r:
                status[0] = r.status_code
                if r.status_code != 200:
                    r.read()
                    events.append({"http_error": r.status_code, "body": r.text})
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        events.append({"done": True})
                        return
                    ev = json.loads(line[len("data: "):])
                    events.append(ev)
                    if on_event is not None and not on_event(ev):
                        return  # leaving the context manager closes the connection

        with ThreadPoolExecutor(2) as ex:
            p = ex.submit(httpx.post, self.prefill.url + path, json=b, timeout=timeout_s)
            d = ex.submit(run_decode)
            d.result()
            return p.result(), events, status[0]

    def wait_idle(self) -> None:
        for n in (self.prefill, self.decode, *self.extra_nodes):
            if n.proc.poll() is None:
                wait_idle(n.url)

    def start_prefill(self, args: list[str] = (), env: dict[str, str] | None = None) -> tuple[Node, int]:  # type: ignore[assignment]
        """An extra prefill node (killed with the cluster); returns it and its bootstrap port."""
        port = free_port()
        node = start_node("prefill", self.model_dir, ["--disaggregation-bootstrap-port", str(port), *self.common_args, *args],
                          env, os.path.dirname(self.prefill.log_path))
        self.extra_nodes.append(node)
        wait_healthy([node])
        return node, port

    def stop(self) -> None:
        # Every node is signalled before any is waited for: a node's graceful exit takes seconds
        # (uvicorn, the scheduler, the registry), and one after the other that added up per cluster.
        nodes = (*self.extra_nodes, self.prefill, self.decode)
        for n in nodes:
            n.signal_group()
        for n in nodes:
            n.reap()


@contextlib.contextmanager
def running_cluster(model_dir: str, backend: str = "mooncake", decode_args: list[str] = (),  # type: ignore[assignment]
                    prefill_args: list[str] = (), env: dict[str, str] | None = None) -> Iterator[Cluster]:  # type: ignore[assignment]
    logdir = tempfile.mkdtemp(prefix="pdc-e2e-")
    boot = free_port()
    common = ["--disaggregation-transfer-backend", backend, "--page-size", "16"]
    p = start_node("prefill", model_dir, ["--disaggregation-bootstrap-port", str(boot), *common, *prefill_args], env, logdir)
    d = start_node("decode", model_dir, [*common, *decode_args], env, logdir)
    cluster = Cluster(p, d, boot, model_dir, common_args=common)
    try:
        wait_healthy([p, d])
        yield cluster
    except BaseException:
        cluster.stop()
        print(f"node logs kept in {logdir}")
        raise
    cluster.stop()
    shutil.rmtree(logdir, ignore_errors=True)  # the logs are only worth keeping when something failed


def page_nbytes(model_dir: str, page_size: int = 16) -> int:
    """Bytes of one KV page (every layer, K and V, float32 on CPU), from the checkpoint's config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4 * page_size


def check_greedy(model_dir: str, prompt: list[int], got: list[int], n: int, what: str) -> None:
    """``got`` equals HF greedy, except after a step where HF's top-2 gap is a near-tie."""
    from tests.reference import hf_greedy

    want, gaps = hf_greedy(model_dir, prompt, n)
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[step] < NEAR_TIE, f"{what}: step {step} got {g}, HF {w} (top-2 gap {gaps[step]:.3g})"
            print(f"{what}: near-tie at step {step} (gap {gaps[step]:.2e})")
            return
    assert len(got) == n and got == want, f"{what}: got {got}, HF {want}"


def check_greedy_text(model_dir: str, decode: Callable[[list[int]], str], prompt: list[int], got: str, n: int,
                      what: str) -> None:
    """``got`` (text, as the OpenAI endpoints answer) is HF greedy detokenized; after a near-tie step
    only the text before that step must match."""
    from tests.reference import hf_greedy

    want, gaps = hf_greedy(model_dir, prompt, n)
    tie = next((k for k, g in enumerate(gaps) if g < NEAR_TIE), n)
    assert got.startswith(decode(want[:tie])), f"{what}: got {got!r}, HF {decode(want)!r}"
    if tie == n:
        assert got == decode(want), f"{what}: got {got!r}, HF {decode(want)!r}"
