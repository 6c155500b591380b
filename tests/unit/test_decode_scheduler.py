"""Decode scheduler core against a fake engine and fake transfer (no model, no network): the rig,
and requests that run to their end (rooms and local requests, batching, stops, logprobs).

The fake engine keeps "KV" as the token id stored in each slot and computes the next token as a
hash of the KV it reads back through the request's req->token row. It asserts that this KV equals
prompt + output so far, so a page freed too early, a wrong row, or a wrong recompute after
retraction fails loudly; outputs are compared with ``reference()``, computed without the scheduler.

The rig is shared: test_decode_faults (failures, rejections, aborts, fences), test_decode_admission
(memory admission, retraction, the new-token ratio, load and metrics) and test_decode_rejections
import it from here.
"""
from __future__ import annotations

import pytest

from collections.abc import Sequence

from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.allocator import PageAllocator
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from common.ipc.protocol import AbortReq, GenerateReq, ReqOutput, WorkItem
from common.request import SamplingParams
from decode_node.admission import DecodeBudget, DecodeBudgetConfig, NewTokenRatio
from common.sched.stop import StopChecker
from decode_node.scheduler import DecodeSchedConfig, DecodeScheduler
from decode_node.stats import DecodeStats
from transfer.aux import AuxPool, AuxRecord
from transfer.base import KVReceiver
from transfer.errors import RoomInUse, TransferError
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
        self.prefix_len = 0  # decode_prefix_len: prompt tokens the decode's own cache holds

    def fenced(self) -> bool:
        return self.held

    def init(self, page_indices: Sequence[int], aux_slot: int | None, state_indices: Sequence[int] = (),
             prompt_digest: str = "", decode_prefix_len: int = 0) -> None:
        assert self.status is KVPoll.WaitingForInput, self.status
        self.pages, self.slot, self.status = list(page_indices), aux_slot, KVPoll.Transferring
        self.prefix_len = decode_prefix_len

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
            raise RoomInUse("room is already in flight on this decode rank", room)
        self.rx[room] = FakeReceiver(self, room)
        return self.rx[room]

    def reject_room(self, room: int, bootstrap_addr: str, reason: str) -> None:
        self.rejected.append((room, bootstrap_addr, reason))

    def complete(self, room: int, logprob: float = -0.5) -> None:
        r = self.rx[room]
        assert r.status is KVPoll.Transferring and r.pages is not None and r.slot is not None
        prompt = self.prompts[room]
        skip = r.prefix_len  # the decode holds these tokens' KV: only the pages past them are written
        assert skip % PS == 0 and skip < len(prompt), skip
        assert len(r.pages) == -(-len(prompt) // PS) - skip // PS, "decode must reserve exactly the prompt's pages"
        for i, t in enumerate(prompt[skip:], start=skip):
            slot = r.pages[(i - skip) // PS] * PS + i % PS
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
                 reserved: int = 4, ratio_init: float = 0.7, stop: StopChecker | None = None,
                 stream_interval: int = 1, prefix_cache: bool = False) -> None:
        alloc = PageAllocator(pages + 1)
        self.memory = KVMemory(alloc, ReqToTokenPool(rows, 256, "cpu"), RadixCache(alloc, PS, enabled=prefix_cache), PS)
        self.engine = FakeEngine(self.memory)
        self.aux = AuxPool(aux_slots, top_k=2)
        self.prompts: dict[int, list[int]] = {}
        self.hub = FakeHub(self.engine, self.aux, self.prompts)
        bcfg = DecodeBudgetConfig(page_size=PS, total_pages=pages, reserved_decode_tokens=reserved,
                                  ratio_init=ratio_init, ratio_min=min(0.1, ratio_init), ratio_decay_steps=600)
        self.sched = DecodeScheduler(
            self.engine, self.memory, self.hub, self.aux, stop or StopChecker([EOS]), DecodeBudget(bcfg),
            NewTokenRatio(bcfg.ratio_init, bcfg.ratio_min, bcfg.ratio_decay_steps),
            DecodeSchedConfig(max_running_requests=max_running, recompute_tokens_per_step=16, check_aux_room=True,
                              stream_interval=stream_interval, fault_step_delay_s=0.0))
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
        # Pages the prefix cache keeps (when on) are free capacity: unlocked, evictable at once.
        assert m["locked_pages"] == 0 and m["free_pages"] + m["evictable_pages"] == m["total_pages"], m
        assert m["free_req_slots"] == m["total_req_slots"], m
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


def test_a_streamed_first_token_leaves_before_the_forward_not_after_it() -> None:
    """The step whose transfer poll finds a streamed request's KV sends its first token and runs
    no forward (which would add a decode step to its TTFT); the next step decodes it with the
    rest. A non-streamed arrival defers nothing, and a stream of arrivals never starves the batch."""
    rig = Rig(max_running=16)
    rig.add("a", prompt_of(1, 5), 40, room=1, stream=True)
    while not rig.outputs.get("a"):
        rig.step()
    rig.step()
    assert rig.engine.decode_batches and rig.engine.decode_batches[-1] == 1  # a is decoding alone
    for rid, room, stream in (("b", 2, True), ("c", 3, False)):
        rig.add(rid, prompt_of(room, 5), 5, room=room, stream=stream)
        while True:
            forwards, seen_a = len(rig.engine.decode_batches), len(rig.outputs["a"])
            rig.step()
            if len(rig.engine.decode_batches) == forwards or rig.engine.decode_batches[-1] > 1:
                break  # b: a step without a forward; c: the first forward that holds it
        if stream:
            assert len(rig.outputs["b"]) == 1 and len(rig.outputs["a"]) == seen_a  # b's first token, no step for a
            rig.step()
            assert rig.engine.decode_batches[-1] == 2 and len(rig.outputs["a"]) == seen_a + 1
        else:
            assert "c" not in rig.outputs  # not streamed: nothing to send early, the forward ran
    forwards = len(rig.engine.decode_batches)
    for i in range(10):  # an arrival every step: every other step still runs the forward
        rig.add(f"s{i}", prompt_of(10 + i, 5), 3, room=10 + i, stream=True)
        rig.step()
    assert len(rig.engine.decode_batches) - forwards >= 4
    rig.run()
    for rid, room, n in [("a", 1, 40), ("b", 2, 5), ("c", 3, 5)] + [(f"s{i}", 10 + i, 3) for i in range(10)]:
        assert rig.tokens(rid) == reference(prompt_of(room, 5), n), rid
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


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_sends_first_token_at_once_then_every_n(interval: int) -> None:
    prompt = prompt_of(7, 5)
    ref = reference(prompt, 11)
    rig = Rig(stream_interval=interval)
    rig.add("s", prompt, 11, room=1, stream=True)
    rig.add("whole", prompt, 11, room=2)  # not streamed: one output at the end, whatever the interval
    rig.run()
    sizes = [len(o.new_token_ids) for o in rig.outputs["s"]]
    assert sizes == ([1] * 11 if interval == 1 else [1, 4, 4, 2])  # the end flushes what is held
    assert rig.tokens("s") == rig.tokens("whole") == ref
    assert [len(o.new_token_ids) for o in rig.outputs["whole"]] == [11]
    rig.assert_clean()


def test_stream_interval_flushes_on_a_stop_token() -> None:
    prompt = prompt_of(6, 5)
    ref = reference(prompt, 6)
    rig = Rig(stop=StopChecker([ref[5]]), stream_interval=4)
    rig.add("s", prompt, 20, room=1, stream=True)
    rig.run()
    assert [len(o.new_token_ids) for o in rig.outputs["s"]] == [1, 4, 1]
    assert rig.tokens("s") == ref[:6] and rig.final("s").finish.type == "stop"  # type: ignore[union-attr]
    rig.assert_clean()


def test_logprobs_first_from_aux_then_from_sampler() -> None:
    rig = Rig()
    rig.add("lp", prompt_of(2, 5), 3, room=1, return_logprob=True, top_logprobs_num=2)
    rig.run()
    fin = rig.final("lp")
    assert fin.new_logprobs == [-0.5, -0.25, -0.25]
    assert fin.new_top_logprobs is not None and fin.new_top_logprobs[0] == [(1, -0.5), (2, -2.0)]
    assert len(fin.new_top_logprobs) == 3 and len(fin.new_top_logprobs[1]) == 2


def test_a_streamed_local_requests_first_token_also_leaves_before_the_forward() -> None:
    """A local request (no room) samples its first token in its compute's last chunk: that token
    goes out in the same step, which runs no decode forward (as for a room's first token)."""
    rig = Rig(max_running=16)
    rig.add("a", prompt_of(1, 5), 40, room=1, stream=True)
    while len(rig.outputs.get("a", [])) < 2:
        rig.step()
    forwards, seen_a = len(rig.engine.decode_batches), len(rig.outputs["a"])
    rig.add("local", prompt_of(2, 7), 4, stream=True)
    rig.step()
    assert len(rig.outputs["local"]) == 1 and rig.tokens("local") == reference(prompt_of(2, 7), 1)
    assert len(rig.engine.decode_batches) == forwards and len(rig.outputs["a"]) == seen_a  # no forward this step
    rig.step()
    assert rig.engine.decode_batches[-1] == 2  # the next step decodes both
    rig.run()
    assert rig.tokens("local") == reference(prompt_of(2, 7), 4)
    rig.assert_clean()


def test_local_request_is_computed_here() -> None:
    rig = Rig()
    rig.add("local", prompt_of(9, 13), 6)
    rig.run()
    assert rig.tokens("local") == reference(prompt_of(9, 13), 6)
    assert rig.engine.extend_tokens == 13
    rig.assert_clean()
