"""Playing the decode side against a real prefill node, for tests/integration/test_prefill_*.py.

``PrefillNodeProc`` runs ``python -m prefill_node`` as a child (killed by PID in ``stop``, its
scheduler too). ``DecodePeer`` is a decode node's transfer side in the test process: a KV pool
of torch tensors and aux rows registered with a real data plane, a ``DecodeKVManager`` that
finds the prefill through its bootstrap server, and a tiny page allocator. ``generate`` does
what the router + a decode node do for one request: POST the prompt to the prefill with a room
while this side reserves pages for that room, then waits for both ends.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from common.kvcache.allocator import PageAllocator
from common.kvcache.pool import KVLayout, KVPool
from common.kvcache.state_pool import StateLayout, StatePool
from common.ports import free_port
from transfer import AuxPool, AuxRecord, KVArgs, KVManagerConfig, KVPoll, create_data_plane
from transfer.aux import AUX_TOP_K  # the aux row layout both nodes use
from transfer.bootstrap import HttpBootstrapClient
from transfer.decode import DecodeKVManager, DecodeKVReceiver

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class PrefillNodeProc:
    """``python -m prefill_node`` on loopback; ``stop`` kills it and its scheduler by PID."""

    def __init__(self, model_dir: str, *flags: str, env: dict[str, str] | None = None, log_path: str | None = None) -> None:
        self.port, self.bootstrap_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "prefill_node", "--model-path", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--disaggregation-bootstrap-port", str(self.bootstrap_port), *flags]
        full_env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PDC_LOG_LEVEL": "WARNING", **(env or {})}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.scheduler_pid: int | None = None

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefill node exited with {self.proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    info = httpx.get(f"{self.url}/server_info", timeout=2.0).json()
                    self.scheduler_pid = info.get("scheduler_pid")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prefill node not healthy within {timeout_s:g} s")

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.scheduler_pid is not None and _pid_alive(self.scheduler_pid):
            os.kill(self.scheduler_pid, signal.SIGKILL)
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]


@dataclass
class Room:
    room: int
    prompt_len: int
    receiver: DecodeKVReceiver
    pages: list[int] = field(default_factory=list)
    aux_slot: int | None = None
    state_slot: int | None = None  # hybrid models: where the prefill writes the recurrent state
    state: KVPoll = KVPoll.Bootstrapping
    reason: str | None = None


class DecodePeer:
    """A decode node's KV receiving side with registered torch buffers (no model, no scheduler)."""

    def __init__(self, layout: KVLayout, num_pages: int = 512, backend: str = "mooncake",
                 config: KVManagerConfig | None = None, state: StateLayout | None = None) -> None:
        self.layout = layout
        self.pool = KVPool(layout, num_pages, "cpu")
        self.aux = AuxPool(16, top_k=AUX_TOP_K)
        self.states = None if state is None else StatePool(state, 16, "cpu")
        self.allocator = PageAllocator(num_pages)
        args = KVArgs(layout=layout, kv=KVArgs.kv_from_pool(self.pool), aux=self.aux.buffers(), aux_top_k=AUX_TOP_K,
                      state=KVArgs.state_from_pool(self.states), state_layout=state)
        engine = create_data_plane(backend, host="127.0.0.1", transfer_timeout_s=2.0)
        self.mgr = DecodeKVManager(args, engine, HttpBootstrapClient(timeout_s=2.0, lookup_timeout_s=5.0),
                                   config or KVManagerConfig.defaults(tick_s=0.02))
        self._rooms = 1 + int.from_bytes(os.urandom(4), "little")

    def close(self) -> None:
        self.mgr.close()

    def new_room(self) -> int:
        self._rooms += 1
        return self._rooms

    # -- one room --------------------------------------------------------------------------------

    def open(self, room: int, bootstrap_addr: str, prompt_len: int, timeout_s: float = 20.0,
             give_up: Callable[[], bool] = lambda: False) -> Room:
        """Create the receiver, wait for the handshake, reserve pages + an aux slot, send TransferInfo."""
        r = Room(room, prompt_len, self.mgr.create_receiver(room, bootstrap_addr))
        r.state = self._wait(r, lambda s: s is not KVPoll.Bootstrapping, timeout_s, give_up)
        if r.state is not KVPoll.WaitingForInput:
            return r
        pages = self.allocator.alloc(-(-prompt_len // self.layout.page_size))
        slot = self.aux.alloc()
        assert pages is not None and slot is not None, "decode peer out of pages or aux slots"
        r.pages, r.aux_slot = pages, slot
        if self.states is not None:
            r.state_slot = self.states.alloc()
            assert r.state_slot is not None, "decode peer out of state slots"
        r.receiver.init(pages, slot, [] if r.state_slot is None else [r.state_slot])
        return r

    def finish(self, r: Room, timeout_s: float = 20.0, give_up: Callable[[], bool] = lambda: False) -> KVPoll:
        r.state = self._wait(r, lambda s: s.terminal, timeout_s, give_up)
        r.reason = r.receiver.failure_reason
        return r.state

    def _wait(self, r: Room, done: Callable[[KVPoll], bool], timeout_s: float, give_up: Callable[[], bool]) -> KVPoll:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = r.receiver.poll()
            if done(st) or give_up():
                return st
            time.sleep(0.005)
        raise TimeoutError(f"room {r.room} stuck in {r.receiver.poll().name} for {timeout_s:g} s")

    def kv(self, r: Room) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of the room's prompt as received. Each [prompt_len, kv_heads, head_dim]."""
        ps = self.layout.page_size
        slots = torch.tensor([p * ps + i for p in r.pages for i in range(ps)][: r.prompt_len])  # [T]
        return [(k[slots].clone(), v[slots].clone()) for k, v in zip(self.pool.k_buffers, self.pool.v_buffers)]

    def state_of(self, r: Room) -> list[torch.Tensor]:
        """Per state buffer (conv layer) the room's state as received. Each [hidden, kernel]."""
        assert self.states is not None and r.state_slot is not None
        return [buf[r.state_slot].clone() for buf in self.states.buffers]

    def aux_record(self, r: Room) -> AuxRecord:
        assert r.aux_slot is not None
        return self.aux.read(r.aux_slot)

    def release(self, r: Room) -> None:
        if r.pages:
            self.allocator.free(r.pages)
        if r.aux_slot is not None:
            self.aux.free(r.aux_slot)
        if r.state_slot is not None and self.states is not None:
            self.states.free(r.state_slot)
        r.pages, r.aux_slot, r.state_slot = [], None, None

    # -- the router's part ---------------------------------------------------------------------

    def generate(self, node: PrefillNodeProc, input_ids: list[int], room: int | None = None,
                 timeout_s: float = 30.0, **body: Any) -> tuple[Room, httpx.Response]:
        """POST one prompt to the prefill's /generate (as the router does) while this side opens the room."""
        room = self.new_room() if room is None else room
        payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                   "bootstrap_host": "127.0.0.1", "bootstrap_port": node.bootstrap_port, "bootstrap_room": room,
                   "stream": False, **body}
        (r,), resp = self.request(node, "/generate", payload, [(room, len(input_ids))], timeout_s)
        return r, resp

    def request(self, node: PrefillNodeProc, path: str, payload: dict, rooms: list[tuple[int, int]],
                timeout_s: float = 30.0) -> tuple[list[Room], httpx.Response]:
        """POST ``payload`` (which names the rooms) while opening each ``(room, prompt_len)`` here."""
        result: dict[str, Any] = {}

        def post() -> None:
            try:
                result["resp"] = httpx.post(f"{node.url}{path}", content=json.dumps(payload), timeout=timeout_s)
            except Exception as exc:  # handed to the caller
                result["exc"] = exc

        t = threading.Thread(target=post, daemon=True)
        t.start()
        # An early error answer (400: the prefill refused the request) means no KV will come.
        answered = lambda: not t.is_alive() and ("exc" in result or result["resp"].status_code != 200)  # noqa: E731
        opened = [self.open(room, f"127.0.0.1:{node.bootstrap_port}", n, timeout_s, answered) for room, n in rooms]
        for r in opened:
            if r.state is not KVPoll.Failed and not answered():
                self.finish(r, timeout_s, answered)
            if answered() and not r.state.terminal:
                r.receiver.abort("the prefill answered with an error")
                self.finish(r, timeout_s)
        t.join(timeout_s)
        if "exc" in result:
            raise result["exc"]
        if "resp" not in result:
            raise TimeoutError(f"the prefill did not answer {path} within {timeout_s:g} s")
        return opened, result["resp"]


# ---- a decode peer in a child process (so a test can SIGKILL it) ----------------------------------


def serve_child(conn: Any, layout: dict[str, Any]) -> None:
    """Child process main: ``("open", room, bootstrap_addr, prompt_len)`` -> ("ok", state name)
    once TransferInfo is out; ``("close",)`` ends. Every command gets one reply."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    torch.set_num_threads(1)
    peer = DecodePeer(KVLayout(**layout))
    conn.send(("ok", "ready"))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                conn.send(("ok", None))
                return
            try:
                _, room, addr, n = cmd
                r = peer.open(room, addr, n)
                conn.send(("ok", r.receiver.poll().name))
            except Exception as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    finally:
        peer.close()
