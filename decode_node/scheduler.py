"""The decode node's scheduler. Plain data in (``add``/``abort``), plain data out (``step`` returns
``ReqOutput``s); ``decode_node.process`` feeds it from ZMQ. One ``step`` moves every queue once::

    GenerateReq ──add──> prealloc: KVReceiver(room) bootstraps (finds the prefill, registers our buffers)
        │  handshake done AND both memory checks pass (decode_node.budget):
        │      row + prompt pages + aux slot; receiver.init() sends TransferInfo
        v
    transfer: poll() ──Failed──> pages + aux slot freed, 503 naming the cause
        │  Success: the prompt's KV is in our pages; the first token (aux row) is appended
        v
    waiting ──prebuilt batch: joins running without a forward (max_running_requests bounds it)
        v
    running ──decode step: one token per request, stop checked──> finished: pages freed
        │  the pool cannot give every request its next page
        v
    retracted: pages freed, tokens kept ──resume, before any new room──> recompute prompt + output
        on this node (extend, no sampling) ──> running
    local request (no room, e.g. /health_generate): enters "retracted" with no output; its
        recompute is a plain prefill whose last chunk samples the first token

Aborts (client gone, /abort_request) are answered at once. A room whose TransferInfo is out may
still be written by the prefill, so its pages wait in ``draining`` until the receiver reports a
terminal state (the transfer layer's fence, bounded by its timeouts), then are freed once; a room
that failed while its prefill may still write (``receiver.fenced()``) waits there until the fence
is lifted (for a peer that never comes back: for good, visible as ``fenced_reqs``).
The queues and these endings live in ``decode_node.queues``.

Retraction resumes by **recompute**, not host offload: the model is here anyway, no host pool
must be budgeted, and recomputed KV gives the same greedy tokens (up to near-ties).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass


from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.req_kv import KVMemory
from common.ipc.protocol import GenerateReq, ReqOutput
from common.request import FinishReason
from decode_node.budget import DecodeBudget, NewTokenRatio
from common.sched.stop import StopChecker
from decode_node.queues import DecodeQueues
from decode_node.req import AuxSlots, DecodeReq, Engine, ReceiverFactory, Stage
from transfer.errors import TransferError
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSchedConfig:
    max_running_requests: int
    recompute_tokens_per_step: int = 2048  # resume budget per step (at least one request resumes)
    check_aux_room: bool = True  # False with the fake backend: it writes no aux row
    drain_warn_s: float = 30.0


class DecodeScheduler(DecodeQueues):
    def __init__(self, engine: Engine, memory: KVMemory, receivers: ReceiverFactory, aux: AuxSlots,
                 stop: StopChecker, budget: DecodeBudget, ratio: NewTokenRatio, cfg: DecodeSchedConfig) -> None:
        super().__init__(memory, receivers, aux, cfg.drain_warn_s)
        self.engine, self.stop, self.budget, self.ratio, self.cfg = engine, stop, budget, ratio, cfg
        self._first_token: list[DecodeReq] = []  # KV landed this step: first token goes out with it

    # ---- input ----------------------------------------------------------------------------------

    def add(self, msg: GenerateReq) -> None:
        params = msg.sampling
        local = msg.bootstrap_room is None
        addr = None
        if not local and msg.bootstrap_host is not None and msg.bootstrap_port is not None:
            addr = f"{msg.bootstrap_host}:{msg.bootstrap_port}"
        r = DecodeReq(rid=msg.rid, prompt=list(msg.input_ids), params=params, stream=msg.stream,
                      room=msg.bootstrap_room, bootstrap_addr=addr, arrival=msg.arrival_time or time.time())
        if msg.rid in self.reqs:
            return self._refuse(r, f"request id {msg.rid!r} is already running on this decode node")
        if self.budget.pages(len(r.prompt) + 1) > self.budget.cfg.total_pages:
            return self._refuse(r, f"{r.label()}: a prompt of {len(r.prompt)} tokens does not fit this decode "
                                   f"node's KV pool ({self.budget.cfg.total_pages * self.budget.cfg.page_size} tokens)")
        if local and r.max_new == 0:
            r.finish = FinishReason(type="length", length=0)
            return self._emit(r)
        if local:
            r.stage = Stage.RETRACTED
            self.retracted.append(r)
        else:
            if msg.bootstrap_host is None or msg.bootstrap_port is None:  # no prefill we could tell
                return self._fail(r, 400, f"{r.label()}: bootstrap_room without bootstrap_host/bootstrap_port")
            try:
                r.receiver = self.receivers.create_receiver(r.room, r.bootstrap_addr)  # type: ignore[arg-type]
            except TransferError as exc:
                return self._fail(r, 400, f"{r.label()}: cannot receive its KV: {exc}")
            self.prealloc.append(r)
        self.reqs[r.rid] = r

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        if not self.reqs:
            self.ratio.reset()
        self._drain()
        self._poll_transfer()
        self._resume_retracted()  # retracted first: they go before any new room
        self._poll_prealloc()
        self._merge_waiting()
        self._decode()
        now = time.time()
        for r in self._first_token:  # their first token leaves with this step's outputs
            r.clock.lap("first_token", now)
        self._first_token.clear()
        out, self._outbox = self._outbox, []
        return out

    # ---- prealloc -> transfer -> waiting --------------------------------------------------------

    def _poll_prealloc(self) -> None:
        if not self.prealloc:
            return
        ratio = self.ratio.value
        alloc = retractable = 0
        budgeted = False  # the budget needs every request's view: built only once a room is ready
        blocked = False  # FIFO: once one room does not fit, later ones wait too (no starvation)
        for r in list(self.prealloc):
            assert r.receiver is not None
            status = r.receiver.poll()
            if status is KVPoll.Failed:
                self._fail(r, 503, f"{r.label()}: KV transfer failed before it started: {r.receiver.failure_reason}")
                continue
            if status is not KVPoll.WaitingForInput or blocked:
                continue
            if not budgeted:
                held = [h.holder() for h in self.running]
                alloc = self.budget.allocatable_pages(
                    self.memory.available_pages(), held, [h.holder() for h in (*self.transfer, *self.waiting)],
                    [h.holder() for h in self.retracted], ratio)
                retractable = sum(h.held_pages for h in held)
                budgeted = True
            if not self.budget.can_prealloc(len(r.prompt), r.max_new, alloc, retractable, ratio) or not self._reserve_room(r):
                blocked = True
                continue
            alloc -= self.budget.pages(len(r.prompt) + self.budget.headroom_tokens(r.steps_left, ratio))
            self.prealloc.remove(r)
            r.stage = Stage.TRANSFER
            self.transfer.append(r)
            assert r.kv is not None and r.receiver is not None
            state = [r.kv.state_slot] if r.kv.state_slot is not None else []
            r.receiver.init(r.kv.pages, r.aux_slot, state)
            r.clock.lap("prealloc")

    def _reserve_room(self, r: DecodeReq) -> bool:
        """Row (with a state slot, for hybrid models) + prompt pages + aux slot, all or nothing."""
        kv = self.memory.admit((), use_cache=False)
        if kv is None:
            return False
        if not self.memory.reserve(kv, len(r.prompt)):
            self.memory.release(kv, None)
            return False
        slot = self.aux.alloc()
        if slot is None:
            self.memory.release(kv, None)
            return False
        r.kv, r.aux_slot = kv, slot
        return True

    def _poll_transfer(self) -> None:
        for r in list(self.transfer):
            assert r.receiver is not None and r.kv is not None and r.aux_slot is not None
            status = r.receiver.poll()
            if status is KVPoll.Failed:
                self._fail(r, 503, f"{r.label()}: KV transfer failed: {r.receiver.failure_reason}")
            elif status is KVPoll.Success:
                rec = self.aux.read(r.aux_slot)
                if self.cfg.check_aux_room and rec.room != r.room:
                    self._fail(r, 500, f"{r.label()}: the aux row holds room {rec.room}, not ours")
                    continue
                self.aux.free(r.aux_slot)
                r.aux_slot, r.receiver = None, None
                r.kv.kv_len = len(r.prompt)
                r.cached_tokens = rec.cached_tokens
                self.transfer.remove(r)
                r.clock.lap("kv_transfer")
                self._first_token.append(r)
                if r.max_new == 0:
                    r.finish = FinishReason(type="length", length=0)
                else:  # the first token, sampled by the prefill
                    top = list(zip(rec.top_ids, rec.top_logprobs))
                    self._append(r, rec.token_id, rec.logprob, top)
                if r.finish is not None:
                    self._finish(r)
                else:
                    r.stage = Stage.WAITING
                    self.waiting.append(r)

    def _merge_waiting(self) -> None:
        """The prebuilt batch: the prompt's KV is in place and the first token came from the
        prefill, so joining the running batch needs no forward."""
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            self._to_running_or_finish(self.waiting.popleft())

    # ---- retraction and resume ------------------------------------------------------------------

    def _resume_retracted(self) -> None:
        budget_left = self.cfg.recompute_tokens_per_step
        while self.retracted and budget_left > 0 and len(self.running) < self.cfg.max_running_requests:
            r = self.retracted[0]
            ids = r.recompute_ids()
            others = [o.holder() for o in (*self.running, *self.waiting, *self.transfer)]
            if not self.budget.can_resume(r.holder(), self.memory.available_pages(), others, self.ratio.value,
                                          alone=not (self.running or self.waiting)):
                return
            kv = self.memory.admit((), use_cache=False)
            if kv is None:
                return
            if not self.memory.reserve(kv, len(ids)):
                self.memory.release(kv, None)
                return
            self.retracted.popleft()
            r.kv = kv
            first = self._recompute(r, ids)
            budget_left -= len(ids)
            if first is not None:
                self._append(r, first.token_id, first.logprob, first.top_logprobs)
            self._to_running_or_finish(r)

    def _recompute(self, r: DecodeReq, ids: Sequence[int]) -> SampledToken | None:
        """Write the KV of ``ids`` in chunks; a request with no output samples its first token."""
        assert r.kv is not None
        chunk = max(self.cfg.recompute_tokens_per_step, 1)
        sampled: SampledToken | None = None
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            spec = SampleSpec(r.params, r.out, r.prompt) if end == len(ids) and not r.out else None
            [sampled] = self.engine.run_extend([ExtendChunk(r.kv.row, ids[start:end], start)], [spec])
        r.kv.kv_len = len(ids)
        return sampled

    def _make_room(self) -> bool:
        """Ensure every running request can take its next page; False: skip this decode step."""
        # The common case, checked without building the budget's view of every request: the next
        # token of each fits in its own pages or the free ones (at least as strict as the budget's
        # own first check, so it never skips a retraction the budget would make).
        pages_for = self.memory.pages_for
        need = sum(max(0, pages_for(r.kv.kv_len + 1) - len(r.kv.pages)) for r in self.running if r.kv is not None)
        if need <= self.memory.available_pages():
            return True
        held = [r.holder() for r in self.running]
        victims, fits = self.budget.pick_victims(held, self.memory.available_pages())
        chosen = [self.running[i] for i in victims]
        for r in chosen:
            self._retract(r)
        if chosen:
            self.ratio.on_retract([r.holder() for r in self.running], self.budget.cfg.retract_decode_steps)
            log.info("retracted %d request(s) (%s); new_token_ratio now %.3f", len(chosen),
                     ", ".join(r.rid for r in chosen), self.ratio.value)
        while not fits and self.waiting:
            # Requests waiting for a running slot hold pages too (only with a full running batch).
            self._retract(self.waiting[-1])
            fits = self.budget.step_pages(self.running[0].holder()) <= self.memory.available_pages()
        if fits:
            return True
        if self.transfer or any(r.kv is not None and not (r.receiver and r.receiver.fenced()) for r in self.draining):
            # Rooms in transfer hold pages that can be retracted once they land, and aborted rooms
            # still draining hold pages that come back once the prefill answers: wait for them
            # rather than fail the request with a false "out of KV memory". Fenced rooms may never
            # come back (a peer that never returns): not worth waiting for.
            return False
        # One request alone outgrows the whole pool (its worst case was capped at admission).
        [r] = self.running
        self._fail(r, 500, f"{r.label()}: out of KV memory: {len(r.prompt) + len(r.out)} tokens exceed this "
                           f"decode node's pool ({self.budget.cfg.total_pages * self.budget.cfg.page_size} tokens)")
        return False

    def _retract(self, r: DecodeReq) -> None:
        self._remove(r)
        self._free(r)
        r.retractions += 1
        self.counters["retractions"] += 1
        r.stage = Stage.RETRACTED
        self.retracted.append(r)

    # ---- decode ---------------------------------------------------------------------------------

    def _decode(self) -> None:
        if not self.running or not self._make_room():
            return
        for r in self.running:
            assert r.kv is not None
            if not self.memory.reserve(r.kv, r.kv.kv_len + 1):
                raise RuntimeError(f"{r.label()}: no page after _make_room said it fits")  # a budget bug
        batch = list(self.running)
        items = [DecodeItem(r.kv.row, r.out[-1], r.kv.kv_len) for r in batch if r.kv is not None]
        specs = [r.sample_spec() for r in batch]
        t0 = time.perf_counter()
        tokens = self.engine.run_decode(items, specs)
        # Step counters split decode time into model time and everything around it (bench, /metrics).
        self.counters["decode_forward_seconds"] += time.perf_counter() - t0
        self.counters["decode_steps"] += 1
        self.counters["decode_batch_reqs"] += len(items)
        self.ratio.on_decode_step()
        for r, tok in zip(batch, tokens):
            assert r.kv is not None
            r.kv.kv_len += 1
            self._append(r, tok.token_id, tok.logprob, tok.top_logprobs)
            if r.finish is not None:
                self.running.remove(r)
                self._finish(r)
            elif r.stream:
                self._emit(r)

    def _append(self, r: DecodeReq, token: int, logprob: float | None, top: Sequence[tuple[int, float]]) -> None:
        r.out.append(token)
        self.counters["generated_tokens"] += 1
        if r.params.return_logprob:
            r.logprobs.append(0.0 if logprob is None else logprob)
            r.top_logprobs.append(list(top)[: r.params.top_logprobs_num])
        r.finish = self.stop.check(r.params, r.out)

    def _to_running_or_finish(self, r: DecodeReq) -> None:
        if r.finish is not None:
            self._finish(r)
            return
        r.stage = Stage.RUNNING
        self.running.append(r)
        if r.stream:
            self._emit(r)
