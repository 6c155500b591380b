"""NodeIO: the scheduler side of the API <-> scheduler IPC, driven by a hand-made API side."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

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
    encode,
)
from common.request import FinishReason, SamplingParams
from common.ipc.node_io import NodeIO, RankWaker, RateMeter


class Stats:
    def __init__(self) -> None:
        self.flushed = 0
        self.broken = False

    def load(self) -> dict[str, int]:
        if self.broken:
            raise RuntimeError("boom")
        return {"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 42}

    def memory(self) -> dict:
        return {"free_pages": 7}

    def metrics(self) -> dict[str, float]:
        return {"num_running_reqs": 2.0}

    def flush_cache(self) -> tuple[bool, str]:
        self.flushed += 1
        return True, "flushed"


class ApiSide:
    """The API process's two sockets, as common.server.SchedulerClient sets them up."""

    def __init__(self, ep: IpcEndpoints) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(ep.from_scheduler)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(ep.to_scheduler)

    def send(self, msg: object) -> None:
        self.push.send(encode(msg))  # type: ignore[arg-type]

    def recv(self, timeout_s: float = 2.0) -> object:
        assert self.pull.poll(int(timeout_s * 1000)), "no message from the scheduler side"
        return decode_from_scheduler(self.pull.recv())

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[NodeIO, ApiSide, Stats]]:
    ep = IpcEndpoints.fresh(str(tmp_path))
    stats = Stats()
    io = NodeIO(ep, stats)
    api = ApiSide(ep)
    try:
        yield io, api, stats
    finally:
        api.close()
        io.close()


def _gen(rid: str) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))


def _drain(io: NodeIO, want: int, timeout_s: float = 2.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += io.recv(timeout_s=0.05)
    return got


def test_work_items_arrive_in_order_and_queries_are_answered(pair: tuple[NodeIO, ApiSide, Stats]) -> None:
    io, api, stats = pair
    api.send(_gen("a"))
    api.send(QueryReq(query_id="q1", what="load"))
    api.send(AbortReq(rid="a"))
    api.send(FlushCacheReq(query_id="q2"))
    api.send(QueryReq(query_id="q3", what="memory"))
    items = _drain(io, 2)
    assert [type(m).__name__ for m in items] == ["GenerateReq", "AbortReq"]
    assert items[0].rid == "a" and items[1].rid == "a"
    replies = {}
    for _ in range(3):
        r = api.recv()
        assert isinstance(r, QueryReply)
        replies[r.query_id] = r.payload
    assert replies["q1"] == {"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 42}
    assert replies["q2"] == {"success": True, "message": "flushed"}
    assert replies["q3"] == {"free_pages": 7}
    assert stats.flushed == 1


def test_malformed_frame_and_failing_stats_do_not_break_the_loop(pair: tuple[NodeIO, ApiSide, Stats]) -> None:
    io, api, stats = pair
    stats.broken = True
    api.push.send(b"\x00not msgpack")
    api.send(QueryReq(query_id="q", what="load"))
    api.send(_gen("b"))
    items = _drain(io, 1)
    assert [m.rid for m in items] == ["b"]
    reply = api.recv()
    assert isinstance(reply, QueryReply) and "boom" in reply.payload["error"]


def test_recv_waits_at_most_the_timeout(pair: tuple[NodeIO, ApiSide, Stats]) -> None:
    io, _, _ = pair
    t0 = time.monotonic()
    assert io.recv(timeout_s=0.05) == []
    assert io.recv(timeout_s=0.0) == []
    assert time.monotonic() - t0 < 1.0


def test_a_wake_from_another_thread_ends_the_wait_at_once(pair: tuple[NodeIO, ApiSide, Stats]) -> None:
    io, api, _ = pair
    threading.Timer(0.2, io.wake).start()
    t0 = time.monotonic()
    assert io.recv(timeout_s=30.0) == []  # woken, nothing to read
    assert time.monotonic() - t0 < 10.0  # not the 30 s timeout (generous: the box is shared)
    for _ in range(10_000):  # many wakes before a wait: one pending wake, no blocking writer
        io.wake()
    assert io.recv(timeout_s=5.0) == []
    t0 = time.monotonic()
    assert io.recv(timeout_s=0.2) == []  # the pending wakes were drained: this one waits again
    assert time.monotonic() - t0 >= 0.15
    api.send(_gen("c"))  # a message still arrives behind the wakes
    assert [m.rid for m in _drain(io, 1)] == ["c"]
    io.close()
    io.wake()  # a transfer thread waking a closed NodeIO is a no-op, not an error


@pytest.mark.parametrize("in_dir", [False, True], ids=["abstract", "socket-files"])
def test_another_ranks_wake_ends_rank_0s_wait(tmp_path, in_dir: bool) -> None:
    ep = IpcEndpoints.fresh(str(tmp_path) if in_dir else None)
    early = RankWaker(ep)
    early.wake()  # before rank 0 bound its socket: dropped, not an error
    io = NodeIO(ep, Stats(), rank_wakes=True)
    waker = RankWaker(ep)
    try:
        threading.Timer(0.2, waker.wake).start()  # rank 1's transfer thread, in another process in life
        t0 = time.monotonic()
        assert io.recv(timeout_s=30.0) == []
        assert time.monotonic() - t0 < 10.0  # woken, not the 30 s timeout
        for _ in range(10_000):  # a burst never blocks the waker, and one recv drains it
            waker.wake()
        assert io.recv(timeout_s=5.0) == []
        t0 = time.monotonic()
        assert io.recv(timeout_s=0.2) == []
        assert time.monotonic() - t0 >= 0.15
    finally:
        io.close()
    waker.wake()  # rank 0 gone: dropped
    waker.close()
    waker.wake()  # closed: a no-op
    early.close()
    if in_dir:
        assert ep.rank_wake_address() in ep.socket_files()  # the launcher's cleanup list has it too
        assert not os.path.exists(ep.rank_wake_address())  # rank 0 removed its socket file


def test_send_batches_outputs_and_skips_empty(pair: tuple[NodeIO, ApiSide, Stats]) -> None:
    io, api, _ = pair
    io.send([])
    io.send([ReqOutput(rid="x", new_token_ids=[5], finish=FinishReason(type="length", length=1)),
             ReqOutput(rid="y", error="room 9 failed", http_status=503)])
    msg = api.recv()
    assert isinstance(msg, BatchOutput)
    assert [i.rid for i in msg.items] == ["x", "y"]
    assert msg.items[0].finish == FinishReason(type="length", length=1)
    assert msg.items[1].http_status == 503
    assert not api.pull.poll(50), "the empty send must not produce a message"


def test_rate_meter_counts_a_sliding_window() -> None:
    m = RateMeter(window_s=10.0)
    assert m.rate(now=0.0) == 0.0
    m.add(10, now=100.0)
    m.add(10, now=102.0)
    assert m.rate(now=104.0) == pytest.approx(20 / 4.0)
    assert m.rate(now=111.0) == pytest.approx(10 / 9.0)  # the first event left the window
    assert m.rate(now=200.0) == 0.0
