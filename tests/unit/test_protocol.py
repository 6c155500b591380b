"""API <-> scheduler messages: round trips, wire tags, and malformed frames dropped (not raised)."""
from __future__ import annotations

import logging
import os
import sys
import tempfile

import msgspec
import pytest
import zmq

from common.ipc.protocol import (
    AbortReq,
    BatchOutput,
    FlushCacheReq,
    GenerateReq,
    IpcEndpoints,
    QueryReply,
    QueryReq,
    ReqOutput,
    decode_from_scheduler,
    decode_to_scheduler,
    encode,
)
from common.request import FinishReason, SamplingParams

TO_SCHED = [
    GenerateReq(rid="r1", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=7, temperature=0.0,
                                                                     stop=["\n\n"], stop_token_ids=[5], seed=3,
                                                                     return_logprob=True, top_logprobs_num=3),
                stream=True, bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=2**63 - 1,
                arrival_time=12.5),
    GenerateReq(rid="local", input_ids=[9], sampling=SamplingParams()),
    AbortReq(rid="r1"),
    FlushCacheReq(query_id="q1"),
    QueryReq(query_id="q2", what="metrics"),
]
FROM_SCHED = [
    BatchOutput(items=[
        ReqOutput(rid="a", new_token_ids=[4, 5], new_logprobs=[-0.5, -1.0],
                  new_top_logprobs=[[(4, -0.5), (6, -2.0)], [(5, -1.0)]], prompt_tokens=3, completion_tokens=2),
        ReqOutput(rid="b", finish=FinishReason(type="abort", message="KV transfer failed for room 7"),
                  error="KV transfer failed for room 7", http_status=503),
        ReqOutput(rid="c", new_token_ids=[2], finish=FinishReason(type="stop", matched=2)),
    ]),
    QueryReply(query_id="q2", payload={"num_running_reqs": 3, "token_usage": 0.5, "nested": {"x": [1, 2]}}),
]


@pytest.mark.parametrize("msg", TO_SCHED, ids=lambda m: type(m).__name__)
def test_to_scheduler_round_trip(msg: object) -> None:
    assert decode_to_scheduler(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", FROM_SCHED, ids=lambda m: type(m).__name__)
def test_from_scheduler_round_trip(msg: object) -> None:
    assert decode_from_scheduler(encode(msg)) == msg  # type: ignore[arg-type]


def test_wire_tags_are_the_documented_names() -> None:
    # Schedulers in other packages match on these strings; renaming a class must not change them.
    tags = {type(m).__name__: msgspec.msgpack.decode(encode(m))["type"] for m in TO_SCHED + FROM_SCHED}
    assert tags == {"GenerateReq": "generate", "AbortReq": "abort", "FlushCacheReq": "flush_cache",
                    "QueryReq": "query", "BatchOutput": "batch_output", "QueryReply": "query_reply"}


@pytest.mark.parametrize("buf", [
    b"",
    b"\xc1",  # never-used msgpack byte
    msgspec.msgpack.encode({"type": "generate", "rid": "x"}),  # missing fields
    msgspec.msgpack.encode({"type": "nope", "rid": "x"}),  # unknown tag
    msgspec.msgpack.encode({"type": "abort", "rid": 5}),  # wrong type
    msgspec.msgpack.encode([1, 2, 3]),
], ids=["empty", "bad-byte", "missing", "unknown-tag", "wrong-type", "array"])
def test_malformed_frames_are_logged_and_dropped(buf: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="common.ipc.protocol"):
        assert decode_to_scheduler(buf) is None
    assert "dropping malformed" in caplog.text


def test_each_direction_rejects_the_other_directions_messages() -> None:
    assert decode_from_scheduler(encode(AbortReq(rid="x"))) is None
    assert decode_to_scheduler(encode(QueryReply(query_id="q", payload={}))) is None


def test_fresh_endpoints_are_distinct_ipc_addresses(tmp_path: object) -> None:
    a, b = IpcEndpoints.fresh(str(tmp_path)), IpcEndpoints.fresh(str(tmp_path))
    addrs = {a.to_scheduler, a.from_scheduler, b.to_scheduler, b.from_scheduler}
    assert len(addrs) == 4 and all(x.startswith(f"ipc://{tmp_path}/") for x in addrs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abstract socket namespace is Linux-only")
def test_default_endpoints_leave_no_socket_files_behind() -> None:
    """Nodes use the default endpoints; a node killed with SIGKILL cannot unlink socket files,
    so on Linux the defaults must not create any (abstract namespace)."""
    ep = IpcEndpoints.fresh()
    assert ep.socket_files() == []
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind(ep.to_scheduler)
        push = ctx.socket(zmq.PUSH)
        push.connect(ep.to_scheduler)
        push.send(encode(FlushCacheReq(query_id="q")))
        assert isinstance(decode_to_scheduler(pull.recv()), FlushCacheReq)
        name = ep.to_scheduler.removeprefix("ipc://@")
        assert not [f for f in os.listdir(tempfile.gettempdir()) if name in f]
    finally:
        ctx.destroy(linger=0)
