"""Decode scheduler core against a fake engine and fake transfer (no model, no network).

The fake engine keeps "KV" as the token id stored in each slot and computes the next token as a
hash of the KV it reads back through the request's req->token row. It asserts that this KV equals
prompt + output so far, so a page freed too early, a wrong row, or a wrong recompute after
retraction fails loudly; outputs are compared with ``reference()``, computed without the scheduler.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.allocator import PageAllocator
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from common.ipc.protocol import AbortReq, GenerateReq, ReqOutput, WorkItem
from common.request import SamplingParams
from decode_node.budget import DecodeBudget, DecodeBudgetConfig, NewTokenRatio
from common.sched.stop import StopChecker
from decode_node.scheduler import DecodeSchedConfig, DecodeScheduler
from decode_node.stats import DecodeStats
from transfer.aux import AuxPool, AuxRecord
from transfer.base import KVReceiver
from transfer.errors import TransferError
from transfer.poll import KVPoll

EOS = 99
PS = 4  # page size


def next_token(seq: Sequence[int]) -> int:
    h = 17
    for t in seq:
        h = (h * 1000003 + t + 1) % 2**61
    return h % 90  # never EOS unless a test says so


def reference(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class FakeEngine:
    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        self.kv: dict[int, int] = {}  # slot -> token id whose "KV" it holds
        self.decode_batches: list[int] = []
        self.extend_tokens = 0

    def _write(self, row: int, start: int, ids: Sequence[int]) -> None:
        slots = self.memory.req_to_token.read(row, start + len(ids), start).tolist()
        for s, t in zip(slots, ids):
            assert self.memory.allocator.is_allocated(s // PS), f"write to free page {s // PS}"
            self.kv[s] = t

    def _read(self, row: int, end: int) -> list[int]:
        slots = self.memory.req_to_token.read(row, end, 0).tolist()
        for s in slots:
            assert self.memory.allocator.is_allocated(s // PS), f"read of free page {s // PS}"
        return [self.kv.get(s, -1) for s in slots]

    def _sample(self, seq: list[int], spec: SampleSpec) -> SampledToken:
        assert spec.prompt_ids is not None
        assert seq == list(spec.prompt_ids) + list(spec.output_ids[:-1]) + (
            [spec.output_ids[-1]] if spec.output_ids else []), "KV does not match prompt + output"
        tok = next_token(seq)
        p = spec.params
        top = [(tok, -0.25), (tok + 1, -1.5)][: p.top_logprobs_num]
        return SampledToken(tok, -0.25 if p.return_logprob else None, top)

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]:
        out: list[SampledToken | None] = []
        for c, spec in zip(chunks, specs):
            self._write(c.row, c.prefix_len, c.input_ids)
            self.extend_tokens += len(c.input_ids)
            out.append(None if spec is None else self._sample(self._read(c.row, c.prefix_len + len(c.input_ids)), spec))
        return out

    def run_decode(self, items: Sequence[DecodeItem], specs: Sequence[SampleSpec]) -> list[SampledToken]:
        self.decode_batches.append(len(items))
        out = []
        for it, spec in zip(items, specs):
            self._write(it.row, it.prefix_len, [it.input_id])
            out.append(self._sample(self._read(it.row, it.prefix_len + 1), spec))
        return out


class FakeReceiver(KVReceiver):
    def __init__(self, hub: FakeHub, room: int) -> None:
        self.hub, self.room = hub, room
        self.status = KVPoll.WaitingForInput if hub.auto_handshake else KVPoll.Bootstrapping
        self.pages: list[int] | None = None
        self.slot: int | None = None
        self.reason: str | None = None
        self.abort_pending: str | None = None
        self.held = False  # Failed while the prefill may still write (the transfer layer's fence)

    def fenced(self) -> bool:
        return self.held

    def init(self, page_indices: Sequence[int], aux_slot: int | None, state_indices: Sequence[int] = ()) -> None:
        assert self.status is KVPoll.WaitingForInput, self.status
        self.pages, self.slot, self.status = list(page_indices), aux_slot, KVPoll.Transferring

    def poll(self) -> KVPoll:
        return self.status

    def abort(self, reason: str = "aborted by decode") -> None:
        if self.status.terminal:
            return
        if self.status is KVPoll.Transferring:
            self.abort_pending = reason  # the prefill may still write: wait for its answer
        else:
            self.status, self.reason = KVPoll.Failed, reason

    @property
    def failure_reason(self) -> str | None:
        return self.reason


class FakeHub:
    """Receiver factory + the prefill's half: ``complete`` writes the prompt KV and the aux row."""

    def __init__(self, engine: FakeEngine, aux: AuxPool, prompts: dict[int, list[int]]) -> None:
        self.engine, self.aux, self.prompts = engine, aux, prompts
        self.rx: dict[int, FakeReceiver] = {}
        self.auto_handshake = True
        self.rejected: list[tuple[int, str, str]] = []  # reject_room calls: (room, addr, reason)

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        if room in self.rx and not self.rx[room].status.terminal:
            raise TransferError("room is already in flight on this decode rank", room)
        self.rx[room] = FakeReceiver(self, room)
        return self.rx[room]

    def reject_room(self, room: int, bootstrap_addr: str, reason: str) -> None:
        self.rejected.append((room, bootstrap_addr, reason))

    def complete(self, room: int, logprob: float = -0.5) -> None:
        r = self.rx[room]
        assert r.status is KVPoll.Transferring and r.pages is not None and r.slot is not None
        prompt = self.prompts[room]
        assert len(r.pages) == -(-len(prompt) // PS), "decode must reserve exactly the prompt's pages"
        for i, t in enumerate(prompt):
            slot = r.pages[i // PS] * PS + i % PS
            assert self.engine.memory.allocator.is_allocated(slot // PS)
            self.engine.kv[slot] = t
        self.aux.write(r.slot, AuxRecord(room=room, token_id=next_token(prompt), cached_tokens=3, logprob=logprob,
                                         top_ids=(1, 2), top_logprobs=(-0.5, -2.0)))
        r.status = KVPoll.Success

    def fail(self, room: int, reason: str) -> None:
        r = self.rx[room]
        r.status, r.reason = KVPoll.Failed, reason

    def transferring(self) -> list[int]:
        return [room for room, r in self.rx.items() if r.status is KVPoll.Transferring and r.abort_pending is None]


class Rig:
    def __init__(self, pages: int = 64, rows: int = 16, aux_slots: int = 16, max_running: int = 8,
                 reserved: int = 4, ratio_init: float = 0.7, stop: StopChecker | None = None) -> None:
        alloc = PageAllocator(pages + 1)
        self.memory = KVMemory(alloc, ReqToTokenPool(rows, 256, "cpu"), RadixCache(alloc, PS, enabled=False), PS)
        self.engine = FakeEngine(self.memory)
        self.aux = AuxPool(aux_slots, top_k=2)
        self.prompts: dict[int, list[int]] = {}
        self.hub = FakeHub(self.engine, self.aux, self.prompts)
        bcfg = DecodeBudgetConfig(page_size=PS, total_pages=pages, reserved_decode_tokens=reserved,
                                  ratio_init=ratio_init, ratio_min=min(0.1, ratio_init))
        self.sched = DecodeScheduler(
            self.engine, self.memory, self.hub, self.aux, stop or StopChecker([EOS]), DecodeBudget(bcfg),
            NewTokenRatio(bcfg.ratio_init, bcfg.ratio_min, bcfg.ratio_decay_steps),
            DecodeSchedConfig(max_running_requests=max_running, recompute_tokens_per_step=16))
        self.stats = DecodeStats(self.sched, aux_slots)
        self.outputs: dict[str, list[ReqOutput]] = {}
        self.inbox: list[WorkItem] = []  # what the API sent since the last step

    def add(self, rid: str, prompt: list[int], max_new: int, room: int | None = None, stream: bool = False,
            **params: object) -> None:
        """The API sends a request: the scheduler takes it at its next step."""
        if room is not None:
            self.prompts.setdefault(room, prompt)
        sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, **params)  # type: ignore[arg-type]
        self.inbox.append(GenerateReq(rid=rid, input_ids=prompt, sampling=sp, stream=stream,
                                      bootstrap_host=None if room is None else "127.0.0.1",
                                      bootstrap_port=None if room is None else 8998, bootstrap_room=room))

    def abort(self, rid: str) -> None:
        self.inbox.append(AbortReq(rid=rid))

    def step(self, complete: bool = True) -> None:
        msgs, self.inbox = self.inbox, []
        self.record(self.sched.step(msgs))
        self.sched.check_integrity()
        if complete:
            for room in self.hub.transferring():
                self.hub.complete(room)

    def record(self, outputs: list[ReqOutput]) -> None:
        for o in outputs:
            assert not self.finished(o.rid), f"output for {o.rid} after its final one"
            self.outputs.setdefault(o.rid, []).append(o)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.sched.idle() and not self.inbox:
                return
            self.step()
        raise AssertionError("scheduler did not go idle")

    def finished(self, rid: str) -> bool:
        return any(o.finish is not None for o in self.outputs.get(rid, []))

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> ReqOutput:
        [last] = [o for o in self.outputs[rid] if o.finish is not None]
        return last

    def assert_clean(self) -> None:
        self.memory.check_integrity()
        self.aux.check_integrity()
        m = self.stats.memory()
        assert m["free_pages"] == m["total_pages"] and m["free_req_slots"] == m["total_req_slots"], m
        assert m["aux_free_slots"] == m["aux_total_slots"] and m["integrity"] == "ok", m
        assert all(r.status.terminal for r in self.hub.rx.values()), "a receiver was never driven to its end"


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 7 + k * 3) % 90 for k in range(n)]


def test_single_room_flows_to_reference_tokens_and_frees_everything() -> None:
    rig = Rig()
    rig.add("a", prompt_of(1, 10), 12, room=1)
    rig.run()
    assert rig.tokens("a") == reference(prompt_of(1, 10), 12)
    fin = rig.final("a")
    assert fin.finish is not None and fin.finish.type == "length" and fin.finish.length == 12
    assert (fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens) == (10, 12, 3)
    assert len(rig.outputs["a"]) == 1  # non-streaming: one output, at the end
    rig.assert_clean()


def test_concurrent_mixed_rooms_batch_together_and_match_reference() -> None:
    rig = Rig()
    cases = {f"r{i}": (prompt_of(i, 3 + 5 * i % 17), 1 + (7 * i) % 15, i % 2 == 0) for i in range(16)}
    for i, (rid, (prompt, n, stream)) in enumerate(cases.items()):
        rig.add(rid, prompt, n, room=100 + i, stream=stream)
    rig.run()
    for rid, (prompt, n, stream) in cases.items():
        assert rig.tokens(rid) == reference(prompt, n), rid
        if stream and n > 2:
            assert len(rig.outputs[rid]) > 1  # streamed token by token
    assert max(rig.engine.decode_batches) > 4  # continuous batching, not one at a time
    c = rig.sched.counters  # step counters agree with what the engine saw
    assert c.decode_steps == len(rig.engine.decode_batches)
    assert c.decode_batch_reqs == sum(rig.engine.decode_batches)
    assert c.decode_forward_seconds > 0
    rig.assert_clean()


def test_first_token_can_finish_without_any_decode_step() -> None:
    rig = Rig()
    prompt = prompt_of(3, 6)
    rig.add("one", prompt, 1, room=1)
    rig.add("eos", prompt_of(4, 6), 5, room=2, stop_token_ids=[next_token(prompt_of(4, 6))])
    rig.add("zero", prompt_of(5, 6), 0, room=3)
    rig.run()
    assert rig.engine.decode_batches == []
    assert rig.tokens("one") == [next_token(prompt)] and rig.final("one").finish.type == "length"  # type: ignore[union-attr]
    stop = rig.final("eos").finish
    assert stop is not None and stop.type == "stop" and stop.matched == next_token(prompt_of(4, 6))
    assert rig.tokens("zero") == [] and rig.final("zero").finish.length == 0  # type: ignore[union-attr]
    rig.assert_clean()


def test_eos_mid_stream_stops_with_matched_token() -> None:
    prompt = prompt_of(6, 5)
    ref = reference(prompt, 6)
    rig = Rig(stop=StopChecker([ref[3]]))  # the 4th token is an EOS for this model
    rig.add("s", prompt, 20, room=1, stream=True)
    rig.run()
    assert rig.tokens("s") == ref[:4]
    fin = rig.final("s").finish
    assert fin is not None and fin.type == "stop" and fin.matched == ref[3]
    rig.assert_clean()


def test_logprobs_first_from_aux_then_from_sampler() -> None:
    rig = Rig()
    rig.add("lp", prompt_of(2, 5), 3, room=1, return_logprob=True, top_logprobs_num=2)
    rig.run()
    fin = rig.final("lp")
    assert fin.new_logprobs == [-0.5, -0.25, -0.25]
    assert fin.new_top_logprobs is not None and fin.new_top_logprobs[0] == [(1, -0.5), (2, -2.0)]
    assert len(fin.new_top_logprobs) == 3 and len(fin.new_top_logprobs[1]) == 2


def test_local_request_is_computed_here() -> None:
    rig = Rig()
    rig.add("local", prompt_of(9, 13), 6)
    rig.run()
    assert rig.tokens("local") == reference(prompt_of(9, 13), 6)
    assert rig.engine.extend_tokens == 13
    rig.assert_clean()


def test_transfer_failure_is_a_503_naming_the_cause_and_frees_the_room() -> None:
    rig = Rig()
    rig.add("f", prompt_of(1, 9), 5, room=7)
    rig.step(complete=False)
    assert rig.memory.allocator.num_free < 64  # pages reserved for the room
    rig.hub.fail(7, "prefill rank 0: boom")
    rig.step(complete=False)
    fin = rig.final("f")
    assert fin.http_status == 503 and fin.error is not None and "boom" in fin.error and "room 7" in fin.error
    assert fin.finish is not None and fin.finish.type == "abort"
    rig.assert_clean()


def test_handshake_failure_before_any_page_is_a_503() -> None:
    rig = Rig()
    rig.hub.auto_handshake = False
    rig.add("h", prompt_of(1, 9), 5, room=7)
    rig.step()
    rig.hub.fail(7, "bootstrap 127.0.0.1:8998: connection refused")
    rig.step()
    assert rig.final("h").http_status == 503 and "connection refused" in (rig.final("h").error or "")
    rig.assert_clean()


def test_duplicate_room_and_oversized_prompt_are_rejected_with_400() -> None:
    rig = Rig(pages=8)
    rig.add("a", prompt_of(1, 5), 3, room=1)
    rig.add("b", prompt_of(2, 5), 3, room=1)
    rig.add("big", list(range(40)), 3, room=2)
    rig.step(complete=False)
    assert rig.final("b").http_status == 400 and "already in flight" in (rig.final("b").error or "")
    assert rig.final("big").http_status == 400 and "does not fit" in (rig.final("big").error or "")
    rig.run()
    assert rig.tokens("a") == reference(prompt_of(1, 5), 3)
    rig.assert_clean()


@pytest.mark.parametrize("stage", ["prealloc", "transfer", "waiting", "running", "retracted"])
def test_abort_in_every_stage_answers_once_and_releases_once(stage: str) -> None:
    rig = Rig(max_running=1)
    if stage in ("waiting", "retracted"):
        rig.add("busy", prompt_of(3, 4), 30, room=3)
        rig.step()
        rig.step()  # "busy" occupies the only running slot
    rig.hub.auto_handshake = stage != "prealloc"
    rig.add("x", prompt_of(1, 9), 30, room=1, stream=True)
    if stage == "retracted":
        rig.abort("x")
        rig.step(complete=False)
        rig.outputs.clear()
        rig.add("x", prompt_of(1, 9), 30)  # a local request waits in the retracted queue to be computed
    q = rig.sched.queues
    stage_queue = {"prealloc": q.prealloc, "transfer": q.transfer, "waiting": q.waiting, "running": q.running,
                   "retracted": q.retracted}[stage]
    for _ in range(3):
        if any(r.rid == "x" for r in stage_queue):
            break
        rig.step(complete=stage != "transfer")
    assert any(r.rid == "x" for r in stage_queue), stage
    rig.abort("x")
    rig.abort("x")  # a second abort is a no-op
    rig.step(complete=False)
    fin = rig.final("x").finish
    assert fin is not None and fin.type == "abort"
    if stage == "transfer":
        # The prefill may still write into the room's pages: they stay held until it answers.
        assert rig.sched.queues.draining and rig.memory.allocator.num_free < 64
        rig.hub.rx[1].status = KVPoll.Failed
    rig.abort("busy")
    rig.run()
    rig.assert_clean()


def test_fenced_room_is_answered_at_once_but_its_memory_held_until_the_fence_lifts() -> None:
    rig = Rig(pages=16)
    rig.add("x", prompt_of(1, 2 * PS), 4, room=1)  # 2 prompt pages
    rig.step(complete=False)
    assert rig.hub.rx[1].status is KVPoll.Transferring
    rig.hub.fail(1, "prefill hung past its bound")
    rig.hub.rx[1].held = True
    rig.step(complete=False)
    fin = rig.final("x")
    assert fin.finish is not None and fin.finish.type == "abort" and fin.http_status == 503
    m = rig.stats.memory()
    assert (m["fenced_reqs"], m["fenced_pages"]) == (1, 2) and m["free_pages"] == 14 and m["aux_free_slots"] == 15
    assert rig.stats.metrics()["fenced_reqs"] == 1 and not rig.sched.idle()
    # A room arriving now gets other pages: the fenced ones are never handed out.
    rig.add("y", prompt_of(2, 2 * PS), 3, room=2)
    for _ in range(20):
        rig.step()
        assert not set(rig.hub.rx[2].pages or []) & set(rig.hub.rx[1].pages or [])
        if rig.finished("y"):
            break
    assert rig.tokens("y") == reference(prompt_of(2, 2 * PS), 3)
    for _ in range(3):
        rig.step()  # still fenced: nothing freed, whatever the number of steps
    assert rig.stats.memory()["fenced_pages"] == 2 and rig.memory.allocator.num_free == 14
    rig.hub.rx[1].held = False  # the peer was proven unable to write
    rig.run()
    assert rig.stats.memory()["fenced_reqs"] == 0 and len([o for o in rig.outputs["x"] if o.finish]) == 1
    rig.assert_clean()


def test_memory_checks_hold_rooms_in_prealloc_until_pages_free() -> None:
    # 12 pages; each room needs 3 prompt pages, and its worst case 3 + 8 = 11 pages.
    rig = Rig(pages=12, reserved=4)
    for i in range(3):
        rig.add(f"m{i}", prompt_of(i, 12), 32, room=i)
    rig.step(complete=False)
    inited = [room for room, r in rig.hub.rx.items() if r.pages is not None]
    assert inited == [0]  # worst case of a second room does not fit beside the first's headroom
    rig.run()
    for i in range(3):
        assert rig.tokens(f"m{i}") == reference(prompt_of(i, 12), 32)
    rig.assert_clean()


def test_forced_retraction_still_gives_reference_tokens() -> None:
    # A tiny pool and a relaxed ratio: admission is optimistic, the pool runs dry, requests retract
    # and resume by recompute (the fake engine checks the recomputed KV token by token).
    rig = Rig(pages=24, rows=16, reserved=1, ratio_init=0.05)
    cases = {f"q{i}": (prompt_of(i, 5 + i), 28) for i in range(6)}
    for i, (rid, (prompt, n)) in enumerate(cases.items()):
        rig.add(rid, prompt, n, room=i, stream=i % 2 == 0)
    rig.run()
    assert rig.sched.counters.retractions > 0
    assert rig.sched.ratio.value > 0.05  # a retraction makes the ratio conservative again
    for rid, (prompt, n) in cases.items():
        assert rig.tokens(rid) == reference(prompt, n), rid
    rig.assert_clean()


def test_retracted_requests_resume_before_new_rooms() -> None:
    rig = Rig(pages=24, reserved=1, ratio_init=0.05)
    for i in range(5):
        rig.add(f"q{i}", prompt_of(i, 8), 30, room=i)
    for _ in range(200):
        rig.step()
        if rig.sched.queues.retracted:
            break
    assert rig.sched.queues.retracted
    rig.add("late", prompt_of(9, 4), 2, room=99)
    rig.step()  # takes "late": its receiver is ready at once, its pages must wait
    while rig.sched.queues.retracted:
        assert rig.hub.rx[99].pages is None, "a new room got pages while a retracted request waited"
        rig.step()
    rig.run()
    assert rig.tokens("late") == reference(prompt_of(9, 4), 2)
    rig.assert_clean()


def test_new_token_ratio_decays_per_decode_step_and_resets_when_idle() -> None:
    rig = Rig()
    r0 = rig.sched.ratio.value
    rig.add("a", prompt_of(1, 4), 10, room=1)
    rig.run()
    steps = len(rig.engine.decode_batches)
    assert steps == 9
    assert rig.sched.ratio.value == pytest.approx(r0 - steps * rig.sched.ratio.decay)
    rig.step()  # idle
    assert rig.sched.ratio.value == r0


def test_load_and_metrics_report_queues() -> None:
    rig = Rig(max_running=1)
    rig.add("r", prompt_of(3, 4), 30, room=3)
    rig.step()
    rig.step()  # "r" occupies the only running slot
    rig.hub.auto_handshake = False
    rig.add("a", prompt_of(1, 4), 10, room=1)  # stays in prealloc: its prefill never answers
    rig.add("b", prompt_of(2, 4), 10)  # local: waits in retracted for the running slot
    rig.step(complete=False)
    [running] = rig.sched.queues.running
    assert running.rid == "r" and running.kv is not None
    load = rig.stats.load()
    assert load == {"num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": len(running.kv.pages) * PS}
    met = rig.stats.metrics()
    assert met["num_running_reqs"] == 1 and met["num_waiting_reqs"] == 2
    assert met["num_prealloc_reqs"] == 1 and met["num_retracted_reqs"] == 1
    ok, _ = rig.stats.flush_cache()
    assert not ok
    rig.abort("a")
    rig.run()
    assert rig.stats.flush_cache()[0]
    rig.assert_clean()


def test_a_request_outgrowing_the_whole_pool_fails_alone_and_cleanly() -> None:
    rig = Rig(pages=4, reserved=1)  # 16 tokens of KV in all
    rig.add("long", prompt_of(1, 6), 30, room=1, stream=True)
    rig.run()
    fin = rig.final("long")
    assert fin.http_status == 500 and "out of KV memory" in (fin.error or "")
    assert rig.tokens("long") == reference(prompt_of(1, 6), 30)[: len(rig.tokens("long"))]
    assert len(rig.tokens("long")) == 16 - 6 + 1  # every slot used: the last token needs none
    rig.assert_clean()


def test_fail_all_answers_every_request_with_500_and_fences_transfers() -> None:
    rig = Rig()
    rig.add("run", prompt_of(1, 5), 20, room=1)
    rig.step()
    rig.step()
    rig.add("xfer", prompt_of(2, 5), 20, room=2)
    rig.add("local", prompt_of(3, 5), 20)
    rig.step(complete=False)  # "xfer" gets its pages; nobody completes it
    assert [r.rid for r in rig.sched.queues.transfer] == ["xfer"]
    rig.record(rig.sched.fail_all("internal error in the decode scheduler: boom"))
    for rid in ("run", "xfer", "local"):
        assert rig.final(rid).http_status == 500 and "boom" in (rig.final(rid).error or "")
    assert rig.sched.queues.draining and rig.hub.rx[2].abort_pending is not None
    rig.hub.rx[2].status = KVPoll.Failed  # the prefill answers the abort
    rig.run()
    rig.assert_clean()
