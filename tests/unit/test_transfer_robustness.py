"""Transfer managers against peers that misbehave or go away mid-operation: what a peer sends can
fail its own rooms, never raise into the scheduler or a worker; shutdown and write failures keep
the fence and still tell the decode. Fake data plane, ZMQ over loopback, in-memory registry."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from tests.unit.test_transfer_fake_flow import (  # noqa: F401  (cluster is a fixture)
    CFG,
    Cluster,
    Side,
    cluster,
    handshake,
    until_terminal,
    wait_for,
)
from transfer import messages as m
from transfer import wire
from transfer.config import KVManagerConfig
from transfer.poll import KVPoll
from transfer.prefill import PrefillKVManager
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
    assert "bad-session" in pm._rejected and "bad-session" not in pm._peers
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
    wait_for(lambda: 6 in pm._tombstones)
    assert pm.create_sender(6).poll() is KVPoll.Failed
