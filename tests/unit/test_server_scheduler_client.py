"""SchedulerClient, the API process's end of the ZMQ link, over real ipc sockets: the test plays the
scheduler (a PULL it binds, a PUSH it connects) and sees exactly what goes over the wire."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from common.ipc.protocol import (
    AbortReq,
    BatchOutput,
    GenerateReq,
    IpcEndpoints,
    QueryReply,
    QueryReq,
    ReqOutput,
    ToScheduler,
    decode_to_scheduler,
    encode,
)
from common.request import FinishReason, SamplingParams
from common.ipc import scheduler_client as scheduler_client_mod
from common.server.app import create_app
from common.server.config import ApiConfig
from common.ipc.scheduler_client import DuplicateRid, SchedulerClient, SchedulerGone, client_rid
from common.tokenizer import Tokenizer

WAIT_S = 5.0


class Rig:
    """A started SchedulerClient and the scheduler's two sockets."""

    def __init__(self, tmp: Path) -> None:
        self.ep = IpcEndpoints.fresh(str(tmp))
        self.client = SchedulerClient(self.ep.to_scheduler, self.ep.from_scheduler)

    async def __aenter__(self) -> Rig:
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.ep.to_scheduler)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.ep.from_scheduler)
        await self.client.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        for sock in (self.pull, self.push):
            sock.close(linger=0)
        self.ctx.term()

    async def recv(self, pred: Callable[[ToScheduler], bool] = lambda m: not isinstance(m, QueryReq)) -> Any:
        """The next message matching ``pred`` (by default: not the start-up load probe)."""
        while True:
            msg = decode_to_scheduler(await asyncio.wait_for(self.pull.recv(), WAIT_S))
            if msg is not None and pred(msg):
                return msg

    async def answer(self, *items: ReqOutput) -> None:
        await self.push.send(encode(BatchOutput(items=list(items))))


def gen(rid: str, ids: list[int] | None = None) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=ids or [1], sampling=SamplingParams())


async def get(q: asyncio.Queue[ReqOutput]) -> ReqOutput:
    return await asyncio.wait_for(q.get(), WAIT_S)


def test_routes_outputs_and_replies(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Rig(tmp_path) as rig:
            c = rig.client
            q = c.register(["a", "b"])
            with pytest.raises(DuplicateRid):
                c.register(["b"])
            c.send(gen("a"))
            c.send(gen("b"))
            wa, wb = (await rig.recv()).rid, (await rig.recv()).rid
            assert (client_rid(wa), client_rid(wb)) == ("a", "b")
            c._dispatch(b"\xc1garbage")  # dropped, logged
            assert not c.ready.is_set()
            await rig.answer(ReqOutput(rid=wa, new_token_ids=[1]),
                             ReqOutput(rid="zzz#0", new_token_ids=[1]),  # nobody listens: dropped
                             ReqOutput(rid=wb, finish=FinishReason(type="length", length=0)))
            got = [await get(q), await get(q)]
            assert [(o.rid, o.new_token_ids) for o in got] == [("a", [1]), ("b", [])] and q.empty()
            assert c.ready.is_set()
            assert c.is_inflight("a") and not c.is_inflight("b")  # a finish unregisters its rid
            q2 = c.register(["b"])  # so the rid may be reused
            task = asyncio.ensure_future(c.query("memory", timeout=WAIT_S))
            ask = await rig.recv(lambda m: isinstance(m, QueryReq) and m.what == "memory")
            await rig.push.send(encode(QueryReply(query_id=ask.query_id, payload={"num_reqs": 4})))
            assert await task == {"num_reqs": 4}
            pending = set(c._queries)  # the start-up probe's own load query may still wait
            with pytest.raises(TimeoutError):
                await c.query("memory", timeout=0.01)
            assert set(c._queries) <= pending  # a timed-out query leaves nothing behind
            c._fail_all("the scheduler process exited")  # what the watchdog does
            for queue, rid in ((q, "a"), (q2, "b")):
                fail = queue.get_nowait()
                assert fail.rid == rid and fail.http_status == 503 and "exited" in (fail.error or "")
            with pytest.raises(SchedulerGone):
                c.register(["c"])

    asyncio.run(scenario())


def test_a_reused_rid_never_gets_the_old_sequences_outputs(tmp_path: Path) -> None:
    """A client disconnects and reuses its rid at once: the old sequence's late token and abort
    answer used to be routed (by rid) into the new request."""

    async def scenario() -> None:
        async with Rig(tmp_path) as rig:
            c = rig.client
            old = c.register(["r"])
            c.send(gen("r", [1]))
            w_old = (await rig.recv()).rid
            c.abort("r")  # a decode node's close(); a prefill node only unregisters
            c.unregister(["r"])
            assert await rig.recv() == AbortReq(rid=w_old)
            new = c.register(["r"])
            c.send(gen("r", [2]))
            sent = await rig.recv()
            assert sent.input_ids == [2] and client_rid(sent.rid) == "r"
            await rig.answer(ReqOutput(rid=w_old, new_token_ids=[9]),
                             ReqOutput(rid=w_old, finish=FinishReason(type="abort", message="aborted")))
            await rig.answer(ReqOutput(rid=sent.rid, new_token_ids=[5]))  # arrives after the stale ones
            out = await get(new)
            assert (out.rid, out.new_token_ids, out.finish) == ("r", [5], None)
            assert new.empty() and old.empty()
            # abort by the client's rid reaches the live sequence; errors name the client's rid
            c.abort("r")
            assert await rig.recv() == AbortReq(rid=sent.rid)
            await rig.answer(ReqOutput(rid=sent.rid, finish=FinishReason(type="abort", message=f"{sent.rid} gone"),
                                       error=f"room 7 (rid {sent.rid}): peer gone", http_status=503))
            out = await get(new)
            assert out.error == "room 7 (rid r): peer gone" and out.finish == FinishReason(type="abort",
                                                                                           message="r gone")
            assert not c.is_inflight("r")
            c.abort("r")  # finished: nothing to abort, nothing sent
            c.register(["s"])
            c.send(gen("s"))
            assert client_rid((await rig.recv()).rid) == "s"

    asyncio.run(scenario())


def test_a_message_that_cannot_be_sent_fails_only_its_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Rig(tmp_path) as rig:
            c = rig.client
            q_bad, q_ok = c.register(["bad"]), c.register(["ok"])
            # A value validation should have stopped (msgpack ints are at most 64 bits).
            c.send(GenerateReq(rid="bad", input_ids=[1], sampling=SamplingParams(seed=2**70)))
            c.send(GenerateReq(rid="ok", input_ids=[1], sampling=SamplingParams(seed=5)))
            out = await get(q_bad)
            assert out.rid == "bad" and out.http_status == 500 and out.finish is not None
            assert "OverflowError" in (out.error or "") and "'bad'" in (out.error or "")
            got = await rig.recv()  # the link still works
            assert isinstance(got, GenerateReq) and got.sampling.seed == 5
            assert c.gone_reason is None and q_ok.empty()
            assert not c.is_inflight("bad") and c.is_inflight("ok")

    asyncio.run(scenario())


def test_a_dead_link_task_turns_health_503(tiny_qwen3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = Tokenizer(tiny_qwen3)

    async def scenario() -> None:
        async with Rig(tmp_path) as rig:  # the app's lifespan starts the client under uvicorn
            c = rig.client
            app = create_app(ApiConfig.for_model_dir("decode", tiny_qwen3), c, tok)
            await rig.answer()  # the scheduler's first message: ready
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
                for _ in range(100):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                assert (await http.get("/health")).status_code == 200

                def cannot_encode(msg: object) -> bytes:
                    raise ValueError("unencodable")

                def buggy_fail(wire: str, why: str) -> None:
                    raise RuntimeError("a bug in the failure path")

                # The per-message handler itself fails: the send task dies after all.
                monkeypatch.setattr(scheduler_client_mod, "encode", cannot_encode)
                monkeypatch.setattr(c, "_fail_request", buggy_fail)
                r = await asyncio.wait_for(http.post("/generate", json={"text": "a"}), WAIT_S)
                assert r.status_code == 503 and "sched-send" in r.json()["error"]["message"]
                health = await http.get("/health")
                assert health.status_code == 503 and "sched-send" in health.json()["error"]["message"]
                r = await asyncio.wait_for(http.post("/generate", json={"text": "a"}), WAIT_S)
                assert r.status_code == 503

    asyncio.run(scenario())
