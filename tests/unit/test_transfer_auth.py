"""The control plane with a cluster secret (transfer/control_auth.py): both managers seal every
message and drop, before any handler runs, what a peer without the secret sends. Real ZMQ
sockets over loopback, the fake data plane, the in-memory registry of test_transfer_fake_flow."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import zmq

from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    Cluster,
    MemoryBootstrap,
    cluster,
    handshake,
    make_side,
    until_terminal,
    wait_for,
)
from transfer import messages as m
from transfer import wire
from transfer.control_auth import OVERHEAD, TAG_BYTES, ControlAuth
from transfer.errors import TransferError
from transfer.poll import KVPoll
from transfer.prefill import PrefillKVManager

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-of-the-cluster-0123456789"
SECURE = replace(CFG, cluster_secret=SECRET)


class SecretBootstrap(MemoryBootstrap):
    """The in-memory registry client, recording the secret the managers bind to it."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: list[str] = []

    def with_secret(self, secret: str) -> SecretBootstrap:
        self.secrets.append(secret)
        return self


@pytest.fixture
def secure(cluster: Cluster) -> Cluster:  # noqa: F811
    cluster.boot = SecretBootstrap()
    return cluster


@pytest.fixture
def raw() -> zmq.Context:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    return sock


def _pull(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def test_seal_and_open_round_trip_and_refuse_anything_else() -> None:
    auth = ControlAuth(SECRET)
    frame = auth.seal(b"payload")
    assert len(frame) == len(b"payload") + OVERHEAD and OVERHEAD > TAG_BYTES
    assert ControlAuth(SECRET + "x").open(frame) is None  # another secret
    assert auth.open(frame) == b"payload"
    assert auth.open(frame) is None  # the same frame again: a replay
    assert auth.open(b"payload") is None  # no tag
    assert auth.open(frame[:-1] + bytes([frame[-1] ^ 1])) is None  # one bit off
    assert auth.open(b"X" + frame[1:]) is None  # payload changed under the tag
    assert auth.open(frame[-TAG_BYTES:]) is None  # a tag alone
    assert SECRET not in repr(auth)
    with pytest.raises(ValueError):
        ControlAuth("")


def test_a_recorded_frame_is_refused_again_and_after_the_window() -> None:
    """What an attacker on the pod network could record (an AbortRoom, a TransferInfo) is worth
    nothing later: within the window its nonce was seen, after it its stamp is too old."""
    sender, receiver = ControlAuth(SECRET), ControlAuth(SECRET, window_s=60)
    abort = m.encode(m.AbortRoom(room=7, session_id="s", status_endpoint="tcp://127.0.0.1:1", reason="x"))
    fresh = sender.seal(abort)
    assert receiver.open(fresh) == abort and receiver.open(fresh) is None
    old = sender.seal(abort, now=time.time() - 61)
    ahead = sender.seal(abort, now=time.time() + 61)
    assert receiver.open(old) is None and receiver.open(ahead) is None
    bounded = ControlAuth(SECRET, max_nonces=8)
    for _ in range(40):
        assert bounded.open(sender.seal(b"ping")) == b"ping"
    assert len(bounded._seen) <= 8


def test_secured_managers_transfer_and_give_the_registry_their_secret(secure: Cluster) -> None:
    pm, _ = secure.prefill(cfg=SECURE)
    dm, _ = secure.decode(cfg=SECURE)
    sender, recv = handshake(pm, dm, room=5, dst_pages=[3, 4])
    sender.send([1, 2], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
    assert secure.boot.secrets == [SECRET, SECRET]  # type: ignore[attr-defined]


def test_a_client_that_cannot_carry_the_secret_is_refused_at_start(cluster: Cluster) -> None:  # noqa: F811
    with pytest.raises(TransferError, match="cannot present the cluster secret"):
        cluster.prefill(cfg=SECURE)  # MemoryBootstrap has no with_secret


def test_the_prefill_drops_unsealed_and_wrongly_sealed_messages_before_any_state_changes(
        secure: Cluster, raw: zmq.Context) -> None:
    pm, p = secure.prefill(cfg=SECURE)
    status, status_ep = _pull(raw)
    sock = _push(raw, pm.endpoint)
    wrong = ControlAuth("another-secret-0123456789abcdef")
    register = m.encode(wire.register_message(p.args, "intruder", "i1", status_ep))
    info = m.encode(m.TransferInfo(room=7, session_id="intruder", instance_id="i1", status_endpoint=status_ep,
                                   dst_pages=[1], aux_slot=0))
    ping = m.encode(m.Ping(seq=1, session_id="intruder", status_endpoint=status_ep))
    for frame in (register, info, ping, wrong.seal(register), wrong.seal(info), wrong.seal(ping), b"", b"x" * 40):
        sock.send(frame)
    time.sleep(0.3)  # the bootstrap thread has long handled them (tick 10 ms)
    t = pm.tables()
    assert t["decodes"] == t["orphans"] == t["heard"] == t["rejected"] == []
    assert status.poll(100) == 0, "an unauthenticated Ping was answered"
    sender = pm.create_sender(7)
    assert sender.poll() is KVPoll.Bootstrapping  # the TransferInfo for room 7 never counted
    # The same messages sealed with the cluster secret are accepted: the thread is alive and
    # the drop above was the tag, not the content.
    good = ControlAuth(SECRET)
    for frame in (register, info, ping):
        sock.send(good.seal(frame))
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    assert "intruder" in pm.tables()["decodes"]
    assert status.poll(2000) and good.open(status.recv()) is not None  # the Pong, sealed
    sender.abort("test over")
    status.close(linger=0)
    sock.close(linger=0)


def test_the_decode_drops_an_unsealed_status_and_keeps_the_room(secure: Cluster, raw: zmq.Context) -> None:
    pm, _ = secure.prefill(cfg=SECURE)
    dm, _ = secure.decode(cfg=SECURE)
    sender, recv = handshake(pm, dm, room=11, dst_pages=[2])
    sock = _push(raw, dm.status_endpoint)
    forged = m.TransferStatus(room=11, status=int(KVPoll.Failed), prefill_rank=0, reason="forged")
    sock.send(m.encode(forged))
    sock.send(ControlAuth("another-secret-0123456789abcdef").seal(m.encode(forged)))
    time.sleep(0.3)
    assert recv.poll() is KVPoll.Transferring  # a forged Failed would have freed pages the prefill may write
    sender.send([5], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
    sock.close(linger=0)


def test_a_decode_without_the_secret_fails_its_room_instead_of_hanging(secure: Cluster) -> None:
    pm, _ = secure.prefill(cfg=SECURE)
    dm, _ = secure.decode(cfg=CFG)  # no secret: its KVArgsRegister and Pings are dropped
    sender = pm.create_sender(21)
    recv = dm.create_receiver(21, ADDR)
    state, _ = until_terminal(recv, timeout=5.0)
    assert state is KVPoll.Failed and "missed" in (recv.failure_reason or "")  # its Pings went unanswered
    assert pm.tables()["decodes"] == []
    sender.abort("test over")


def test_bad_secret_config_never_reaches_repr() -> None:
    assert SECRET not in repr(SECURE)
    side = make_side()
    with pytest.raises(TransferError):
        PrefillKVManager(side.args, side.engine, MemoryBootstrap(), ADDR, SECURE)
