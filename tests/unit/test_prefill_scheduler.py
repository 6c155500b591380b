"""PrefillScheduler on hand-made inputs: real KV bookkeeping, a stub engine, senders whose state the test sets.

Each scenario drives ``step`` and checks the replies, what was sent for each room (pages in order,
each once, aux on the last chunk), and ``check_integrity`` after every step.

This file holds that harness and the failure scenarios (a failed room, an abort, a transfer
timeout, a forward error, bad input); test_prefill_flow holds the requests that succeed and
test_prefill_interleavings the random interleavings. test_prefill_lpm, test_prefill_robustness
and test_grafana_dashboard import the harness from here too.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from common.engine.driver import SampleSpec
from common.engine.model_runner import ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.allocator import PageAllocator
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from common.ipc.protocol import AbortReq, GenerateReq, ReqOutput
from common.request import SamplingParams
from prefill_node.admission import PrefillBudget
from common.sched.stop import StopChecker
from prefill_node.scheduler import PrefillSchedConfig, PrefillScheduler
from prefill_node.stats import PrefillStats
from transfer.aux import AuxRecord
from transfer.base import KVSender
from transfer.errors import RoomInUse, TransferError
from transfer.poll import KVPoll

EOS = 99  # never sampled by the stub engine (its tokens are < 50)


class StubSender(KVSender):
    """A room whose state the test moves; ``writing`` models a write in flight (the fence)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None
        self.sent: list[tuple[list[int], bool, AuxRecord | None]] = []
        self.aborts: list[str] = []
        self.writing = False
        self.prefix_len = 0  # decode_prefix_len: what the decode's TransferInfo says it holds

    @property
    def decode_prefix_len(self) -> int:
        return self.prefix_len

    def send(self, page_indices: Sequence[int], last_chunk: bool, aux: AuxRecord | None = None,
             state_indices: Sequence[int] = ()) -> None:
        assert self.state in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed), self.state
        assert not any(last for _, last, _ in self.sent), "send after the last chunk"
        self.sent.append((list(page_indices), last_chunk, aux))
        if self.state is not KVPoll.Failed:
            self.state = KVPoll.Transferring

    def poll(self) -> KVPoll:
        if self.state is KVPoll.Failed and self.writing:
            return KVPoll.Transferring
        return self.state

    def abort(self, reason: str = "aborted by prefill") -> None:
        self.aborts.append(reason)
        if not self.state.terminal:
            self.state, self.reason = KVPoll.Failed, reason

    @property
    def failure_reason(self) -> str | None:
        return self.reason if self.state is KVPoll.Failed else None

    def fail(self, reason: str) -> None:
        self.state, self.reason = KVPoll.Failed, reason

    @property
    def pages(self) -> list[int]:
        return [p for pages, _, _ in self.sent for p in pages]


class Senders:
    def __init__(self) -> None:
        self.by_room: dict[int, StubSender] = {}

    def __call__(self, room: int, prompt_digest: str = "") -> StubSender:
        if room in self.by_room and not self.by_room[room].state.terminal:
            raise RoomInUse("room is already in flight on this prefill rank", room)
        s = self.by_room[room] = StubSender(room)
        return s


class StubEngine:
    """Records each forward; the sampled token is a function of the prompt so tests can predict it."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, list[int], int, bool]]] = []  # (row, ids, prefix, sampled)
        self.fail_next = False

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fault")
        self.calls.append([(c.row, list(c.input_ids), c.prefix_len, s is not None) for c, s in zip(chunks, specs)])
        out: list[SampledToken | None] = []
        for s in specs:
            if s is None:
                out.append(None)
                continue
            tok = token_for(list(s.prompt_ids or []))
            top = [(tok, -0.25), (tok + 1, -1.5)][: s.params.top_logprobs_num]
            out.append(SampledToken(tok, -0.25 if s.params.return_logprob else None, top))
        return out


def token_for(prompt: list[int]) -> int:
    return sum(prompt) % 50


class Node:
    def __init__(self, page_size: int = 4, pages: int = 64, rows: int = 8, ctx: int = 256, max_tokens: int = 64,
                 chunk: int | None = None, policy: str = "fcfs", timeout_s: float = 5.0, ahead_pages: int = 0) -> None:
        alloc = PageAllocator(pages + 1)  # + the reserved page 0
        self.memory = KVMemory(alloc, ReqToTokenPool(rows, ctx, "cpu"), RadixCache(alloc, page_size), page_size)
        self.engine = StubEngine()
        self.senders = Senders()
        self.now = 0.0
        cfg = PrefillSchedConfig(PrefillBudget(max_tokens, chunk), policy, timeout_s, aux_top_k=2,  # type: ignore[arg-type]
                                 context_len=None, ahead_pages=ahead_pages)
        self.sched = PrefillScheduler(self.engine, self.memory, self.senders, StopChecker([EOS]), cfg, clock=lambda: self.now)
        self.stats = PrefillStats(self.sched)
        self.replies: dict[str, ReqOutput] = {}

    def step(self, *msgs: GenerateReq | AbortReq) -> list[ReqOutput]:
        out = self.sched.step(list(msgs))
        for o in out:
            assert o.rid not in self.replies, f"{o.rid} answered twice"
            self.replies[o.rid] = o
        self.sched.check_integrity()
        return out

    def sender(self, room: int) -> StubSender:
        return self.senders.by_room[room]

    def ready(self, *rooms: int) -> None:
        for r in rooms:
            self.sender(r).state = KVPoll.WaitingForInput

    def assert_idle(self) -> None:
        assert not self.sched.queues.reqs
        mem = self.stats.memory()
        assert mem["held_pages"] == 0 and mem["free_req_slots"] == mem["total_req_slots"]
        assert mem["free_pages"] + mem["cached_pages"] == mem["total_pages"]
        assert mem["locked_pages"] == 0


def gen(rid: str, ids: list[int], room: int | None = None, max_new: int = 8, **sampling: object) -> GenerateReq:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, **sampling)  # type: ignore[arg-type]
    return GenerateReq(rid=rid, input_ids=ids, sampling=sp, bootstrap_host=None if room is None else "127.0.0.1",
                       bootstrap_port=None if room is None else 8998, bootstrap_room=room)


def prompt(n: int, base: int = 1) -> list[int]:
    return [(base + i) % 200 + 100 for i in range(n)]


# ---- failure, abort, timeout -------------------------------------------------------------------


BLOCKER = 99  # room of a request that holds every page while the one under test waits


def _to_stage(node: Node, stage: str, length: int = 10) -> None:
    """Bring request "a" (room 1) into ``stage``; "waiting" uses a blocker that holds the pool."""
    if stage == "waiting":
        node.step(gen("blocker", prompt(node.memory.allocator.num_total * node.memory.page_size, base=90), room=BLOCKER))
        node.ready(BLOCKER)
        node.step()
        assert node.sched.queues.inflight and node.memory.available_pages() == 0
    node.step(gen("a", prompt(length), room=1))
    if stage == "bootstrap":
        return
    node.ready(1)
    node.step()
    assert (node.sched.queues.chunked is not None) == (stage == "chunked")
    assert [r.rid for r in node.sched.queues.waiting] == (["a"] if stage == "waiting" else [])
    assert ([r.rid for r in node.sched.queues.inflight] == ["a"]) == (stage == "inflight")


def _release_blocker(node: Node) -> None:
    if BLOCKER in node.senders.by_room:
        node.sender(BLOCKER).state = KVPoll.Success
        node.step()
        node.replies.pop("blocker")


@pytest.mark.parametrize("stage", ["bootstrap", "waiting", "chunked", "inflight"])
def test_failed_room_in_any_queue_releases_once_with_503(stage: str) -> None:
    node = Node(page_size=4, chunk=4 if stage == "chunked" else None)
    _to_stage(node, stage)
    node.sender(1).fail("decode 10.0.0.2:17000 unreachable")
    (out,) = node.step()
    assert out.http_status == 503 and out.finish is not None and out.finish.type == "abort"
    assert out.error is not None and "room 1" in out.error and "unreachable" in out.error
    _release_blocker(node)
    node.assert_idle()
    assert node.step() == []


@pytest.mark.parametrize("stage", ["bootstrap", "waiting", "chunked", "inflight"])
def test_abort_in_any_queue_waits_for_the_fence_then_releases_once(stage: str) -> None:
    node = Node(page_size=4, chunk=4 if stage == "chunked" else None)
    _to_stage(node, stage)
    s = node.sender(1)
    s.writing = stage in ("chunked", "inflight")  # a write of this room is in flight
    out = node.step(AbortReq(rid="a"))
    assert s.aborts == ["aborted by the client"]
    if s.writing:
        assert out == [] and node.stats.memory()["held_pages"] > 0, "pages kept while a write may read them"
        assert node.sched.queues.inflight and node.sched.queues.chunked is None
        calls = len(node.engine.calls)
        assert node.step() == [] and len(node.engine.calls) == calls, "an aborted request computes nothing more"
        s.writing = False
        out = node.step()
    (reply,) = out
    assert reply.finish is not None and reply.finish.type == "abort" and reply.http_status is None
    _release_blocker(node)
    node.assert_idle()
    assert node.step(AbortReq(rid="a")) == [], "an unknown rid is ignored"


def test_transfer_timeout_aborts_the_room() -> None:
    node = Node(timeout_s=2.0)
    _to_stage(node, "inflight")
    s = node.sender(1)
    s.writing = True  # a hung write: the room stays Transferring after abort until it returns
    node.now = 1.0
    assert node.step() == [] and s.aborts == []
    node.now = 2.5
    assert node.step() == [] and s.aborts and "not done within 2 s" in s.aborts[0]
    s.writing = False
    (out,) = node.step()
    assert out.http_status == 503 and "not done within 2 s" in (out.error or "")
    node.assert_idle()


def test_forward_error_fails_the_batch_and_the_node_keeps_serving() -> None:
    node = Node()
    node.step(gen("a", prompt(6), room=1))
    node.ready(1)
    node.engine.fail_next = True
    out = node.step(gen("b", prompt(6, base=9), max_new=1))  # b is local; both run in the failing forward
    assert len(node.engine.calls) == 0
    assert [o.rid for o in out] == ["b"] and out[0].http_status == 500 and "device fault" in (out[0].error or "")
    (out_a,) = node.step()  # the room's abort took effect: released now
    assert out_a.rid == "a" and out_a.http_status == 500
    assert node.sender(1).aborts
    node.assert_idle()
    node.step(gen("c", prompt(6, base=3), room=2))
    node.ready(2)
    node.step()
    node.sender(2).state = KVPoll.Success
    (ok,) = node.step()
    assert ok.rid == "c" and ok.error is None
    node.assert_idle()


def test_bad_input_is_rejected_before_any_pool_is_touched() -> None:
    node = Node(page_size=4, pages=4, ctx=64)
    before = node.stats.memory()
    out = node.step(
        gen("empty", [], room=1),
        gen("long", prompt(65), room=2),
        gen("big", prompt(20), room=3),  # 5 pages > 4
        gen("local", prompt(4), room=None, max_new=5),
    )
    by = {o.rid: o for o in out}
    assert set(by) == {"empty", "long", "big", "local"}
    assert all(o.http_status == 400 for o in out)
    assert "empty prompt" in by["empty"].error and "context length" in by["long"].error  # type: ignore[operator]
    assert "KV pages" in by["big"].error and "router" in by["local"].error  # type: ignore[operator]
    assert node.stats.memory() == before and not node.sched.queues.reqs
    # The decode of each rejected room is told at once (its room aborted with the reason),
    # instead of holding its pages until the bootstrap timeout.
    for room, rid in ((1, "empty"), (2, "long"), (3, "big")):
        s = node.sender(room)
        assert s.state is KVPoll.Failed and len(s.aborts) == 1 and s.aborts[0] in (by[rid].error or "")
    assert node.sched.counters.rejected == 4 and node.sched.counters.failed == 0
    node.step(gen("ok", prompt(4), room=5))
    (dup,) = node.step(gen("dup", prompt(4), room=5))
    assert dup.http_status == 409 and "already in flight" in (dup.error or "")  # 409: the live one is left alone
    assert node.sender(5).aborts == [], "the live request owning the room is left alone"
    (dup,) = node.step(gen("dup2", [], room=5))
    assert dup.http_status == 400 and node.sender(5).aborts == []
