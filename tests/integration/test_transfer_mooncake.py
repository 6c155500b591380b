"""Prefill and decode transfer managers in two processes, real Mooncake engine over TCP on loopback.

Each side runs in a child process (``_transfer_peer.serve``); the prefill child embeds the real
bootstrap server, the decode looks it up over HTTP. Bytes are checked page by page against the
prefill's pool; failures are produced by SIGKILLing a child.
"""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import _transfer_peer
from _transfer_peer import LAYOUT, PeerSpec

from common.ports import free_port
from common.tools.pipe_peer import PeerProcess

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.integration

KVPOLL = {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3, "Success": 4}
CFG = dict(bootstrap_timeout_s=5.0, waiting_timeout_s=20.0, heartbeat_interval_s=0.2, heartbeat_max_failures=3,
           hung_peer_quarantine_s=1.0, tick_s=0.02)
HEARTBEAT_BOUND_S = CFG["heartbeat_interval_s"] * (CFG["heartbeat_max_failures"] + 1)
TRANSFER_TIMEOUT_S = 5.0  # mooncake's floor for MC_TRANSFER_TIMEOUT
BUFFERS = 2 * LAYOUT["num_layers"]
# A forkserver that has imported torch and mooncake once: children start in about a second
# instead of re-importing torch each (spawn), without forking pytest itself. (Python 3.11's
# forkserver ignores sys.path, so only site-packages modules can be preloaded.)
_mp = multiprocessing.get_context("forkserver")
_mp.set_forkserver_preload(["torch", "mooncake.engine", "zmq", "msgspec", "aiohttp", "numpy"])


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    """Stop the forkserver (and its resource tracker) with this module: no helper process outlives it."""
    try:
        yield
    finally:
        from multiprocessing import forkserver, resource_tracker

        forkserver._forkserver._stop()  # type: ignore[attr-defined]  # waits for it to exit
        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


class Child(PeerProcess):
    """One peer (``_transfer_peer.serve``) in a forkserver child; errors fail the test."""

    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        super().__init__(_transfer_peer.serve, (spec,), name=f"{spec.role} peer", start_timeout_s=90,
                         error=AssertionError, context=_mp)

    def call(self, *cmd: Any, timeout: float = 15.0) -> Any:  # type: ignore[override]
        return super().call(*cmd, timeout_s=timeout)

    def poll(self, room: int) -> tuple[int, str | None]:
        return tuple(self.call("poll", room))  # type: ignore[return-value]

    def wait(self, room: int, states: set[str], timeout: float) -> tuple[str, str | None, float]:
        """Poll until the room is in one of ``states``; return (state, reason, seconds waited)."""
        want = {KVPOLL[s] for s in states}
        names = {v: k for k, v in KVPOLL.items()}
        t0, last = time.monotonic(), None
        while True:
            st, reason = self.poll(room)
            assert last is None or st == 0 or st >= last, f"room {room} went back from {names[last]} to {names[st]}"
            last = st
            if st in want:
                return names[st], reason, time.monotonic() - t0
            if st in (0, 4):
                raise AssertionError(f"room {room} ended {names[st]} ({reason}), wanted {states}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"room {room} stuck in {names[st]} after {timeout}s")
            time.sleep(0.01)


def start(role: str, port: int, backend: str = "mooncake", seed: int = 0) -> Child:
    return Child(PeerSpec(role=role, backend=backend, bootstrap_port=port, seed=seed, config=CFG,
                          transfer_timeout_s=TRANSFER_TIMEOUT_S))


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children started by a test; all stopped (killed if need be) afterwards."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for c in reversed(started):  # decode first: a prefill going away is noisy on the decode
            c.stop()


def handshake(p: Child, d: Child, room: int, dst_pages: list[int], aux_slot: int | None = 1) -> None:
    p.call("sender", room)
    d.call("receiver", room, f"127.0.0.1:{p.spec.bootstrap_port}")
    d.wait(room, {"WaitingForInput"}, timeout=10)
    d.call("init", room, dst_pages, aux_slot)
    p.wait(room, {"WaitingForInput"}, timeout=10)


def assert_pages_equal(p: Child, src: list[int], d: Child, dst: list[int]) -> None:
    theirs, ours = p.call("pages", src), d.call("pages", dst)
    assert len(theirs) == len(ours) == BUFFERS
    for b in range(BUFFERS):
        assert ours[b] == theirs[b], f"buffer {b}: decode pages {dst} differ from prefill pages {src}"


def runs(src: list[int], dst: list[int]) -> int:
    return 1 + sum(1 for i in range(1, len(src)) if (src[i] - src[i - 1], dst[i] - dst[i - 1]) != (1, 1))


@pytest.mark.parametrize("backend", ["mooncake", "fake"])
def test_scattered_pages_and_aux_land(children: list[Child], backend: str) -> None:
    port = free_port()
    p = start("prefill", port, backend)
    children.append(p)
    d = start("decode", port, backend)
    children.append(d)
    zeros = d.call("pages", [10, 11, 12, 13, 50, 51, 3, 14])
    chunks_src = [[5, 6, 7, 20], [30, 31, 100]]
    chunks_dst = [[10, 11, 12, 13], [50, 51, 3]]
    handshake(p, d, room=41, dst_pages=sum(chunks_dst, []), aux_slot=2)
    p.call("send", 41, chunks_src[0], False, None)
    aux = dict(room=0, token_id=123, cached_tokens=8, logprob=-0.5, top_ids=(123, 4), top_logprobs=(-0.5, -1.5),
               kv_digest=bytes(range(101, 117)))  # the KV's digest travels in the row too
    p.call("send", 41, chunks_src[1], True, aux)
    assert p.wait(41, {"Success"}, timeout=10)[0] == "Success"
    assert d.wait(41, {"Success"}, timeout=10)[0] == "Success"
    expected = sum(runs(s, t) for s, t in zip(chunks_src, chunks_dst)) * LAYOUT["num_layers"] * 2 + 1  # +1 aux row
    assert p.call("stats")["descriptors"] == expected == 4 * 6 + 1
    if backend == "fake":  # same state machine, no bytes
        assert d.call("pages", [10, 11, 12, 13, 50, 51, 3, 14]) == zeros
        return
    assert_pages_equal(p, sum(chunks_src, []), d, sum(chunks_dst, []))
    assert d.call("pages", [14, 0]) == d.call("pages", [15, 1])  # neighbours untouched (still zero)
    assert d.call("aux", 2) == {**aux, "room": 41}  # stamped with the room by the prefill
    # More descriptors than one engine batch takes (398 runs x 6 buffers > 2000): split, still exact.
    src = list(range(1, 399))
    dst = src[::-1]  # descending: no two pages merge
    handshake(p, d, room=42, dst_pages=dst, aux_slot=None)
    p.call("send", 42, src, True, None)
    assert p.wait(42, {"Success"}, timeout=20)[0] == "Success"
    assert d.wait(42, {"Success"}, timeout=20)[0] == "Success"
    assert_pages_equal(p, src, d, dst)
    stats = p.call("stats")
    assert stats["descriptors"] == expected + len(src) * BUFFERS and stats["rooms"] == 0 and stats["sticky"]


def test_malformed_messages_and_unreachable_bootstrap(children: list[Child]) -> None:
    port = free_port()
    p = start("prefill", port)
    children.append(p)
    d = start("decode", port)
    children.append(d)
    ctx = zmq.Context()
    try:
        for endpoint in (p.info["endpoint"], d.info["endpoint"]):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint)
            for junk in (b"", b"\xff\x00junk", b"\x82\xa4type\xa6status\xa4room\xa1x"):
                sock.send(junk)
            sock.send_multipart([b"a", b"b"])
            sock.close()
    finally:
        ctx.term()
    d.call("receiver", 7, f"127.0.0.1:{free_port()}")  # nothing listens there
    state, reason, took = d.wait(7, {"Failed"}, timeout=5)
    assert "unreachable" in (reason or "") and took < 3
    handshake(p, d, room=8, dst_pages=[9, 10])
    p.call("send", 8, [3, 4], True, None)
    assert d.wait(8, {"Success"}, timeout=10)[0] == "Success"
    assert_pages_equal(p, [3, 4], d, [9, 10])


def test_decode_killed_mid_transfer_then_restarted(children: list[Child]) -> None:
    port = free_port()
    p = start("prefill", port)
    children.append(p)
    d = start("decode", port)
    children.append(d)
    # 12 chunks of 199 scattered pages = ~14k descriptors: long enough to kill the decode mid-way.
    chunk = list(range(1, 398, 2))
    handshake(p, d, room=1, dst_pages=chunk * 12)
    handshake(p, d, room=2, dst_pages=[5])  # a second room bound to the same decode, not sending
    for i in range(12):
        p.call("send", 1, chunk, i == 11, None)
    time.sleep(0.05)
    assert p.poll(1)[0] == KVPOLL["Transferring"]
    d.kill()
    t0 = time.monotonic()
    for room in (1, 2):
        state, reason, _ = p.wait(room, {"Failed"}, timeout=TRANSFER_TIMEOUT_S + 5)
        assert "unreachable" in (reason or ""), reason
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 3
    stats = p.call("stats")
    assert stats["rooms"] == 0 and stats["sticky"] and set(stats["terminal"].values()) == {0}
    d2 = start("decode", port)  # restarted decode: new session, registers again
    children.append(d2)
    handshake(p, d2, room=3, dst_pages=[7, 8, 9])
    p.call("send", 3, [20, 21, 22], True, None)
    assert d2.wait(3, {"Success"}, timeout=10)[0] == "Success"
    assert_pages_equal(p, [20, 21, 22], d2, [7, 8, 9])


def test_prefill_killed_then_restarted(children: list[Child]) -> None:
    port = free_port()
    p = start("prefill", port)
    children.append(p)
    d = start("decode", port)
    children.append(d)
    handshake(p, d, room=1, dst_pages=[1, 2])  # TransferInfo out: the prefill may write
    p.call("sender", 2)
    d.call("receiver", 2, f"127.0.0.1:{port}")
    d.wait(2, {"WaitingForInput"}, timeout=10)
    p.kill()
    t0 = time.monotonic()
    for room in (1, 2):
        _, reason, _ = d.wait(room, {"Failed"}, timeout=HEARTBEAT_BOUND_S + 3)
        assert "heartbeat" in (reason or ""), reason
    assert time.monotonic() - t0 < HEARTBEAT_BOUND_S + 1.0
    p2 = start("prefill", port, seed=1)  # restarted on the same bootstrap port
    children.append(p2)
    handshake(p2, d, room=3, dst_pages=[30, 31])
    p2.call("send", 3, [40, 41], True, None)
    assert d.wait(3, {"Success"}, timeout=10)[0] == "Success"
    assert_pages_equal(p2, [40, 41], d, [30, 31])
