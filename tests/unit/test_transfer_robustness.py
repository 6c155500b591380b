"""Transfer managers against peers that misbehave or go away mid-operation: what a peer sends can
fail its own rooms, never raise into the scheduler or a worker; shutdown and write failures keep
the fence and still tell the decode. Fake data plane, ZMQ over loopback, in-memory registry."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    Cluster,
    Side,
    cluster,
    handshake,
    make_side,
    until_terminal,
    wait_for,
)
from transfer import messages as m
from transfer import wire
from transfer.backends.fake import FakeDataPlane
from transfer.backends.mooncake import MooncakeDataPlane
from transfer.config import KVManagerConfig
from transfer.descriptors import Descriptors
from transfer.poll import KVPoll
from transfer.zmq_io import PushSockets

# Each test is a few seconds at most; a regression may hang on a peer that never answers.
pytestmark = pytest.mark.timeout(60)

BAD = "tcp://decode-host-without-port"  # ZMQ's connect() raises EINVAL on it


@pytest.fixture
def raw_push() -> Iterator[tuple[zmq.Context, list[zmq.Socket]]]:
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        yield ctx, socks
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def _push_to(raw: tuple[zmq.Context, list[zmq.Socket]], endpoint: str) -> zmq.Socket:
    ctx, socks = raw
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    socks.append(sock)
    return sock


def _register(side: Side, session: str, status_endpoint: str) -> m.KVArgsRegister:
    return wire.register_message(side.args, session, "i1", status_endpoint)


@pytest.mark.parametrize("endpoint,ok", [
    ("tcp://127.0.0.1:5555", True), ("tcp://decode-7.internal:17001", True), ("tcp://[::1]:9", True),
    (BAD, False), ("tcp://:5", False), ("tcp://h:0", False), ("tcp://h:70000", False), ("tcp://*:5", False),
    ("tcp://h:5;h:6", False), ("ipc:///tmp/x", False), ("tcp://h:abc", False), ("tcp://::1:5", False),
])
def test_endpoint_check(endpoint: str, ok: bool) -> None:
    assert (wire.bad_endpoint(endpoint) is None) == ok


def test_push_send_to_an_unparsable_endpoint_returns_false() -> None:
    ctx = zmq.Context()
    push = PushSockets(ctx)
    try:
        msg = m.Pong(seq=1, endpoint="x", instance_id="y")
        assert push.send(BAD, msg) is False  # ZMQ's connect raised; the socket is closed, not cached
        assert push.endpoints() == []
        assert push.send(BAD, msg) is False
    finally:
        push.close()
        ctx.destroy(linger=0)  # also closes a socket a failed connect() might have leaked


def test_decode_with_unusable_status_endpoint_is_refused_and_fails_only_its_rooms(
        cluster: Cluster, raw_push: tuple[zmq.Context, list[zmq.Socket]]) -> None:
    pm, p = cluster.prefill()
    dm, _ = cluster.decode()
    early = pm.create_sender(9)  # sender first, TransferInfo later
    sock = _push_to(raw_push, pm.endpoint)
    sock.send(m.encode(_register(p, "bad-session", BAD)))
    for room in (7, 9):  # 7 before its sender (would be an orphan), 9 after
        sock.send(m.encode(m.TransferInfo(room=room, session_id="bad-session", instance_id="i1",
                                          status_endpoint=BAD, dst_pages=[1, 2], aux_slot=0)))
    sock.send(m.encode(m.Ping(seq=1, session_id="bad-session", status_endpoint=BAD)))
    ok_sender, ok_recv = handshake(pm, dm, room=3, dst_pages=[4])  # a healthy decode meanwhile
    wait_for(lambda: early.poll() is KVPoll.Failed)
    assert "status endpoint" in (early.failure_reason or "")
    late = pm.create_sender(7)  # its TransferInfo was refused: fails at once, not at the timeout
    assert late.poll() is KVPoll.Failed and "status endpoint" in (late.failure_reason or "")
    late.abort("client went away")  # must not raise (it used to raise ZMQError from connect)
    early.abort("client went away")
    assert "bad-session" in pm.tables()["rejected"] and "bad-session" not in pm.tables()["decodes"]
    ok_sender.send([2], last_chunk=True)
    assert until_terminal(ok_sender)[0] is KVPoll.Success and until_terminal(ok_recv)[0] is KVPoll.Success
    wait_for(lambda: pm.num_rooms() == 0)


def test_abort_from_a_decode_with_unusable_endpoint_still_fails_the_room(
        cluster: Cluster, raw_push: tuple[zmq.Context, list[zmq.Socket]]) -> None:
    pm, _ = cluster.prefill()
    sender = pm.create_sender(5)
    sock = _push_to(raw_push, pm.endpoint)
    sock.send(m.encode(m.AbortRoom(room=5, session_id="s", status_endpoint=BAD, reason="gone")))
    sock.send(m.encode(m.AbortRoom(room=6, session_id="s", status_endpoint=BAD, reason="gone")))
    st, took = until_terminal(sender)
    assert st is KVPoll.Failed and took < 0.5
    wait_for(lambda: 6 in pm.tables()["tombstones"])
    assert pm.create_sender(6).poll() is KVPoll.Failed


class SlowEngine(FakeDataPlane):
    """Each write takes ``delay_s`` (a peer slow to acknowledge); records writes against close()."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.running = 0
        self.writes = 0
        self.running_at_close: int | None = None
        self.writes_after_close = 0
        self._count = threading.Lock()

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        with self._count:
            self.running += 1
            self.writes += 1
            if self.running_at_close is not None:
                self.writes_after_close += 1
        time.sleep(self.delay_s)
        with self._count:
            self.running -= 1
        return super().write(peer_session, desc)

    def close(self) -> None:
        with self._count:
            self.running_at_close = self.running
        super().close()


def test_close_fails_queued_rooms_and_closes_the_engine_after_the_last_write(cluster: Cluster) -> None:
    side = make_side()
    side.engine = SlowEngine(delay_s=0.4)
    pm, _ = cluster.prefill(side)
    dm, _ = cluster.decode()
    rooms = [2, 4, 6, 8, 10]  # all on worker 0 (room % 2): one queue
    pairs = [handshake(pm, dm, room=r, dst_pages=[1]) for r in rooms]
    pairs[0][0].send([1], last_chunk=True)
    wait_for(lambda: side.engine.running == 1)
    for sender, _ in pairs[1:]:  # queued behind the running write (a worker groups only what is queued)
        sender.send([1], last_chunk=True)
    t0 = time.monotonic()
    pm.close()
    took = time.monotonic() - t0
    assert side.engine.running_at_close == 0, "engine closed under a running write"
    assert side.engine.writes_after_close == 0
    assert side.engine.writes == 1, "chunks queued behind the running one were skipped"
    assert took < 2 * side.engine.delay_s + 0.5, f"close waited {took:.1f}s"
    for sender, recv in pairs[1:]:  # failed by the shutdown, and their decodes are told so
        assert sender.poll() is KVPoll.Failed and "shutting down" in (sender.failure_reason or "")
        assert until_terminal(recv)[0] is KVPoll.Failed and "shutting down" in (recv.failure_reason or "")


class _StandInMooncake:
    """The two engine calls MooncakeDataPlane makes around close, with a write that blocks."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.in_write = threading.Event()
        self.unregistered: list[int] = []
        self.write_done_before_unregister: bool | None = None

    def batch_transfer_sync_write(self, session: str, src: object, dst: object, lens: object) -> int:
        self.in_write.set()
        self.release.wait(5)
        return 0

    def unregister_memory(self, ptr: int) -> int:
        self.write_done_before_unregister = self.release.is_set()
        self.unregistered.append(ptr)
        return 0


def _mooncake_with(engine: _StandInMooncake, close_wait_s: float) -> MooncakeDataPlane:
    mc = MooncakeDataPlane.__new__(MooncakeDataPlane)  # no real engine: only the locking is under test
    mc._engine, mc._registered, mc._closed, mc._writes = engine, [0x1000], False, 0
    mc._lock = threading.Lock()
    mc._idle = threading.Condition(mc._lock)
    mc._close_wait_s = close_wait_s
    mc.max_batch_entries = 2000
    return mc


def test_mooncake_close_waits_for_a_running_write() -> None:
    eng = _StandInMooncake()
    mc = _mooncake_with(eng, close_wait_s=5.0)
    desc = Descriptors([1], [2], [8])
    results: list[bool] = []
    writer = threading.Thread(target=lambda: results.append(mc.write("peer", desc)))
    writer.start()
    assert eng.in_write.wait(2)
    closer = threading.Thread(target=mc.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive() and eng.unregistered == [], "close must wait for the write"
    assert mc.write("peer", desc) is False, "no new write once closing"
    eng.release.set()
    writer.join(2)
    closer.join(2)
    assert results == [True] and eng.unregistered == [0x1000] and eng.write_done_before_unregister


def test_mooncake_close_leaves_the_engine_if_a_write_never_returns() -> None:
    eng = _StandInMooncake()
    mc = _mooncake_with(eng, close_wait_s=0.2)
    writer = threading.Thread(target=mc.write, args=("peer", Descriptors([1], [2], [8])))
    writer.start()
    assert eng.in_write.wait(2)
    mc.close()
    assert eng.unregistered == [], "memory stays registered under the running write"
    eng.release.set()
    writer.join(2)


def test_write_failure_statuses_reach_the_decode_before_its_socket_is_purged(cluster: Cluster) -> None:
    """The Failed statuses for every room of an unreachable decode are queued and the socket to it
    purged in the same call; they must still arrive (not wait out the decode's waiting timeout)."""
    cfg = KVManagerConfig(**{**CFG.__dict__, "waiting_timeout_s": 3.0, "heartbeat_interval_s": 5.0})
    pm, p = cluster.prefill(cfg=cfg)
    dm, d = cluster.decode(cfg=cfg)
    pairs = [handshake(pm, dm, room=r, dst_pages=[r]) for r in (1, 2, 3)]
    p.engine.fail_session(d.engine.session_id)
    pm._push.purge(dm.status_endpoint)  # no connection to the decode's status port up yet
    pairs[0][0].send([3], last_chunk=True)
    for _, recv in pairs:
        st, took = until_terminal(recv, timeout=5)
        assert st is KVPoll.Failed and "unreachable" in (recv.failure_reason or ""), recv.failure_reason
        assert took < 1.5


@pytest.mark.parametrize("info_first", [True, False])
def test_a_room_the_prefill_rejected_fails_on_the_decode_at_once(cluster: Cluster, info_first: bool) -> None:
    """What the prefill scheduler does with a request it refuses (400): create its sender and abort
    it. The decode then fails its room at once, whether its TransferInfo came first or comes later
    (answered from the tombstone), instead of holding the pages until the bootstrap timeout."""
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    recv = dm.create_receiver(4, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    if info_first:
        recv.init([1, 2], 0)
        wait_for(lambda: 4 in pm.tables()["orphans"])
    sender = pm.create_sender(4)
    sender.abort("prompt of 9000 tokens exceeds the context length 8192")
    assert sender.poll() is KVPoll.Failed  # released: the manager keeps only a tombstone
    if not info_first:
        recv.init([1, 2], 0)
    st, took = until_terminal(recv)
    assert st is KVPoll.Failed and "context length" in (recv.failure_reason or "") and took < 0.5
    assert pm.num_rooms() == 0


def test_decode_reject_room_fails_the_prefill_sender_now(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    early = pm.create_sender(1)  # the prefill already has the request
    dm.reject_room(1, ADDR, "request id 'x' is already running on this decode node")
    st, took = until_terminal(early)
    assert st is KVPoll.Failed and "already running" in (early.failure_reason or "") and took < 0.5
    dm.reject_room(2, ADDR, "prompt does not fit")  # the prefill gets the request later
    wait_for(lambda: 2 in pm.tables()["tombstones"])
    late = pm.create_sender(2)
    assert late.poll() is KVPoll.Failed and "does not fit" in (late.failure_reason or "")
    assert dm.num_rooms() == 0


def test_decode_reject_room_leaves_a_room_live_here_alone(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    sender = pm.create_sender(3)
    recv = dm.create_receiver(3, ADDR)  # the live request that owns room 3
    dm.reject_room(3, ADDR, "a duplicate asked for room 3")
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([1], 0)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([2], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
