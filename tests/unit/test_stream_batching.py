"""A stream that falls behind its outputs sends them joined (Inflight.next_batch), losing nothing.

No server and no scheduler: a stub link hands the API process's ``Inflight`` a queue, the test
fills it as the scheduler would in one burst, then reads what the stream would send. The expected
text is what one-output-at-a-time folding (``Inflight.next``) gives for the same outputs.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from common.ipc.protocol import ReqOutput
from common.request import FinishReason
from common.server.config import ApiConfig
from common.server.generation import Inflight, _stream
from common.server.metrics import ApiMetrics
from common.server.parse_openai import parse_completion
from common.tokenizer import Tokenizer


class StubLink:
    """What Inflight needs of SchedulerClient: one queue for the request's rids; sends recorded."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent: list = []
        self.aborted: list[str] = []

    def register(self, rids: list[str]) -> asyncio.Queue:
        return self.queue

    def unregister(self, rids: list[str]) -> None:
        pass

    def send(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.sent.append(msg)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def cfg(tiny_qwen3: str) -> ApiConfig:
    return ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=256)


def start(cfg: ApiConfig, tok: Tokenizer, n: int) -> tuple[Inflight, StubLink]:
    req = parse_completion({"prompt": "the cache", "n": n, "max_tokens": 8, "temperature": 0, "stream": True},
                           cfg, tok)
    link = StubLink()
    inflight = Inflight(link, req, tok, ApiMetrics("decode", "m"), abort_on_close=True,  # type: ignore[arg-type]
                        endpoint="completions", registry={})
    inflight.start(None)
    return inflight, link


def outputs(inflight: Inflight, per_sub: list[list[int]], fail_last: bool = False) -> list[ReqOutput]:
    """One output per token, interleaved across sequences as a decode batch emits them."""
    rids = [s.sub.rid for s in inflight.states]
    outs = []
    for k in range(max(len(t) for t in per_sub)):
        for rid, toks in zip(rids, per_sub):
            if k < len(toks):
                last = k == len(toks) - 1
                outs.append(ReqOutput(rid=rid, new_token_ids=[toks[k]],
                                      finish=FinishReason(type="length", length=len(toks)) if last else None))
    if fail_last:
        outs[-1] = ReqOutput(rid=outs[-1].rid, finish=FinishReason(type="abort", message="peer died"),
                             error="peer died", http_status=503)
    return outs


def one_at_a_time(cfg: ApiConfig, tok: Tokenizer, per_sub: list[list[int]]) -> list[str]:
    async def run() -> list[str]:
        inflight, link = start(cfg, tok, len(per_sub))
        for o in outputs(inflight, per_sub):
            link.queue.put_nowait(o)
        while not inflight.done:
            assert await inflight.next() is not None
        return [s.text for s in inflight.states]
    return asyncio.run(run())


def test_a_burst_becomes_one_entry_per_sequence_with_the_same_text(cfg: ApiConfig, tok: Tokenizer) -> None:
    ids = tok.encode(" the cache node sends pages to the decode")
    per_sub = [ids[:7], ids[3:8]]
    expected = one_at_a_time(cfg, tok, per_sub)

    async def run() -> None:
        inflight, link = start(cfg, tok, 2)
        for o in outputs(inflight, per_sub):
            link.queue.put_nowait(o)
        batch = await inflight.next_batch()
        assert batch is not None
        assert [s.sub.rid for s, _ in batch] == [s.sub.rid for s in inflight.states]  # first-seen order
        assert [delta for _, delta in batch] == expected  # every token's text, joined per sequence
        assert inflight.done and link.queue.empty()
    asyncio.run(run())


def test_outputs_arriving_one_by_one_are_not_held_back(cfg: ApiConfig, tok: Tokenizer) -> None:
    ids = tok.encode(" the cache node")

    async def run() -> None:
        inflight, link = start(cfg, tok, 1)
        outs = outputs(inflight, [ids])
        for o in outs:
            link.queue.put_nowait(o)
            batch = await inflight.next_batch()
            assert batch is not None and len(batch) == 1
        assert inflight.done
    asyncio.run(run())


def test_a_failure_is_not_merged_into_the_text_before_it(cfg: ApiConfig, tok: Tokenizer) -> None:
    ids = tok.encode(" the cache node sends")

    async def run() -> None:
        inflight, link = start(cfg, tok, 1)
        for o in outputs(inflight, [ids], fail_last=True):
            link.queue.put_nowait(o)
        (s, delta), = await inflight.next_batch()  # type: ignore[misc]
        assert not s.failed and delta == tok.decode(ids[:-1])
        (s2, _), = await inflight.next_batch()  # type: ignore[misc]
        assert s2 is s and s.failed and s.http_status == 503
    asyncio.run(run())


def test_a_disconnect_behind_outputs_still_ends_the_stream(cfg: ApiConfig, tok: Tokenizer) -> None:
    ids = tok.encode(" the cache node")

    async def run() -> None:
        inflight, link = start(cfg, tok, 1)
        link.queue.put_nowait(outputs(inflight, [ids])[0])
        link.queue.put_nowait(None)  # what the disconnect watcher enqueues
        batch = await inflight.next_batch()
        assert batch is not None and len(batch) == 1
        assert await inflight.next_batch() is None
    asyncio.run(run())


def test_the_stream_writes_once_per_batch_and_ends_in_the_same_write(cfg: ApiConfig, tok: Tokenizer) -> None:
    """What the HTTP body yields is what reaches the socket, one send() per item: the first
    token's frames alone (it is not held back), then a burst's frames, the last one and
    ``[DONE]`` joined into one write, with the same frames a frame-per-write stream would send."""
    ids = tok.encode(" the cache node sends pages")

    async def run() -> list[bytes]:
        inflight, link = start(cfg, tok, 1)
        for o in outputs(inflight, [ids]):
            link.queue.put_nowait(o)
        response = await _stream(inflight, tok)
        return [chunk async for chunk in response.body_iterator]  # type: ignore[attr-defined]

    chunks = asyncio.run(run())
    assert len(chunks) == 2, chunks
    frames = [f for f in b"".join(chunks).split(b"\n\n") if f]
    assert frames[-1] == b"data: [DONE]" and chunks[1].endswith(b"data: [DONE]\n\n")
    bodies = [json.loads(f[len(b"data: "):]) for f in frames[:-1]]
    assert "".join(b["choices"][0]["text"] for b in bodies) == tok.decode(ids)
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
    assert all(f.startswith(b"data: ") for f in frames)
