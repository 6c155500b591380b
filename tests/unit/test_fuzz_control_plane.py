"""Malformed and truncated frames on every control-plane socket: the prefill manager's PULL (its
bootstrap/control port) and the decode manager's status PULL, without and with the cluster secret.

hypothesis draws frames: random bytes, every message type encoded and cut at a random point,
valid tags with fields of the wrong type, sealed garbage (right secret, junk inside), oversized
frames and multipart messages. Oracle: the receiving threads stay alive, the rooms the managers
track do not change, and a real handshake + transfer still succeeds afterwards.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.transfer_harness import CFG, Cluster, cluster, handshake, until_terminal  # noqa: F401 (fixture)
from transfer import messages as m
from transfer.control_auth import ControlAuth
from transfer.poll import KVPoll

SECRET = "fuzz-cluster-secret-0123456789abcdef"
VALID = [  # cut short before use: a whole valid message is a legitimate one, not a fuzz case
    m.KVArgsRegister(session_id="s", instance_id="i", status_endpoint="tcp://127.0.0.1:1", tp_rank=0, tp_size=1,
                     page_size=4, kv_ptrs=[1], kv_nbytes=[64], kv_item_nbytes=[4], aux_ptrs=[2], aux_nbytes=[64],
                     aux_item_nbytes=[8]),
    m.TransferInfo(room=7, session_id="s", instance_id="i", status_endpoint="tcp://127.0.0.1:1", dst_pages=[1, 2],
                   aux_slot=0),
    m.AbortRoom(room=7, session_id="s", status_endpoint="tcp://127.0.0.1:1", reason="x"),
    m.Ping(seq=1, session_id="s", status_endpoint="tcp://127.0.0.1:1"),
    m.TransferStatus(room=7, status=4, prefill_rank=0),
    m.Pong(seq=1, endpoint="tcp://127.0.0.1:1", instance_id="i"),
]
FIELDS_JUNK = st.one_of(st.none(), st.integers(-2**63, 2**64 - 1), st.text(max_size=8), st.binary(max_size=8),
                        st.lists(st.integers(), max_size=3), st.floats(allow_nan=False))


def _valid_frames() -> list[bytes]:
    return [msgspec.msgpack.encode(msg) for msg in VALID]


def frames() -> st.SearchStrategy[list[bytes]]:
    valid = _valid_frames()
    tags = ["kv_args", "transfer_info", "abort", "ping", "status", "pong", "nope"]
    one = st.one_of(
        st.binary(max_size=200),
        st.sampled_from(valid).flatmap(lambda raw: st.integers(0, len(raw) - 1).map(lambda k: raw[:k])),  # truncated
        st.builds(lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}), st.sampled_from(tags),
                  st.dictionaries(st.sampled_from(["room", "status", "session_id", "dst_pages", "aux_slot",
                                                   "status_endpoint", "prefill_rank", "instance_id", "reason"]),
                                  FIELDS_JUNK, max_size=5)),
    )
    return st.lists(one, min_size=1, max_size=3)  # several frames = a multipart message


def _rooms(mgr: object) -> int:
    return len(getattr(mgr, "_rooms"))


def _threads_alive() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("pdc-")}


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_control_sockets_drop_malformed_frames_and_keep_serving(cluster: Cluster, ctx: zmq.Context,
                                                                 secret: str | None) -> None:
    cfg = replace(CFG, cluster_secret=secret)
    if secret is not None:
        cluster.boot.with_secret = lambda s: cluster.boot  # type: ignore[attr-defined]
    pm, _ = cluster.prefill(cfg=cfg)
    dm, _ = cluster.decode(cfg=cfg)
    threads = _threads_alive()
    socks = {}
    for name, endpoint in (("prefill", pm.endpoint), ("decode", dm.status_endpoint)):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(endpoint)
        socks[name] = s
    auth = ControlAuth(secret) if secret else None

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(parts=frames(), to=st.sampled_from(["prefill", "decode"]), sealed=st.booleans())
    def send(parts: list[bytes], to: str, sealed: bool) -> None:
        if auth is not None and sealed:
            parts = [auth.seal(p) for p in parts]  # the right secret around junk
        socks[to].send_multipart(parts)

    send()
    for s in socks.values():  # oversized frames, once each (too big to shrink usefully)
        s.send(b"\x00" * (1 << 20))
        if auth is not None:
            s.send(auth.seal(b"\x01" * (1 << 20)))
    time.sleep(0.3)  # let the receivers chew through what was sent
    assert _threads_alive() == threads, f"threads died: {threads - _threads_alive()}"
    assert _rooms(pm) == 0 and _rooms(dm) == 0, "a malformed frame created or changed a room"
    sender, recv = handshake(pm, dm, room=21, dst_pages=[1, 2])
    sender.send([3, 4], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
