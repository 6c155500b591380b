"""The decode node's scheduler: plain data in (API messages), plain data out (``ReqOutput``s), one
``step`` at a time; the node loop (``common.node.process``) feeds it from ZMQ. A step moves every
queue (``DecodeQueues``) once::

    GenerateReq ──arrive──> prealloc: KVReceiver(room) bootstraps (finds the prefill, registers our buffers)
        │  handshake done AND both memory checks pass (decode_node.admission):
        │      row + prompt pages + aux slot; receiver.init() sends TransferInfo
        v
    transfer: poll() ──Failed──> pages + aux slot freed, 503 naming the cause
        │  Success: the prompt's KV is in our pages; the first token (aux row) is appended
        v
    waiting ──prebuilt batch: joins running without a forward (max_running_requests bounds it)
        v
    running ──decode step: one token per request, stop checked──> finished: pages freed
        (a step whose transfers streamed first tokens sends them before any forward; the
        forward is the next step's)
        │  the pool cannot give every request its next page
        v
    retracted: pages freed, tokens kept ──resume, before any new room──> recompute prompt + output
        on this node (extend, no sampling) ──> running
    local request (no room: /health_generate, or a next turn the router sends here alone,
        --decode-local-prefill-tokens): enters "retracted" with no output; its recompute is a plain
        prefill (past its cached prefix, with the prefix cache on) whose last chunk samples the
        first token, sent like a room's first token: before the step's forward

Aborts (client gone, /abort_request) are answered at once. A room whose TransferInfo is out may
still be written by the prefill, so its pages wait in ``draining`` until the receiver reports a
terminal state (the transfer layer's fence, bounded by its timeouts), then are freed once; a room
that failed while its prefill may still write (``receiver.fenced()``) waits there until the fence
is lifted (for a peer that never comes back: for good, visible as ``fenced_reqs``). A request
leaves by ``_finish``, ``_fail`` (only once its receiver is terminal), ``_refuse`` or ``_abort``.

Constrained decoding (``grammar``): the matcher is compiled off the loop from arrival on (the
same spec the prefill compiled, from the same request body); the first token the prefill sampled
under it advances it before the request's first decode step, and a request joins ``running`` only
once its grammar is ready (it waits in ``waiting`` holding its pages; the batch runs on). Every
later token advances it; a complete grammar finishes the request (stop), a compile error or
timeout or a refused token ends it with a 400 (``DecodeReq.grammar_ready``).

Retraction resumes by **recompute**, not host offload: the model is here anyway, no host pool
must be budgeted, and recomputed KV gives the same greedy tokens (up to near-ties).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.grammar.cache import GrammarCache
from common.grammar.spec import spec_of
from common.grammar.state import GrammarState
from common.ipc.protocol import GenerateReq, ReqOutput, WorkItem
from common.kvcache.req_kv import KVMemory
from common.request import FinishReason
from common.sched.stop import StopChecker
from decode_node.admission import DecodeBudget, NewTokenRatio
from decode_node.ports import AuxSlots, Engine, ReceiverFactory
from decode_node.req import DecodeCounters, DecodeQueues, DecodeReq, Stage
from transfer.errors import RoomInUse, TransferError
from transfer.messages import prompt_digest
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSchedConfig:
    """The scheduler's view of the node's settings (built in ``DecodePart.build_scheduler``; no
    defaults of its own but ``drain_warn_s``, which is not a setting)."""

    max_running_requests: int
    recompute_tokens_per_step: int  # resume budget per step (at least one request resumes)
    check_aux_room: bool  # False with the fake backend: it writes no aux row
    stream_interval: int  # a streamed request's tokens go out every this many (first and last at once)
    # FAULT INJECTION, tests only (PDC_FAULT_DECODE_STEP_DELAY_S; 0: off): sleep this long after each
    # decode step, so a test can act on a request mid-generation however fast the steps are.
    fault_step_delay_s: float
    drain_warn_s: float = 30.0  # a room draining this long is logged (and again every as long)


class DecodeScheduler:
    def __init__(self, engine: Engine, memory: KVMemory, receivers: ReceiverFactory, aux: AuxSlots,
                 stop: StopChecker, budget: DecodeBudget, ratio: NewTokenRatio, cfg: DecodeSchedConfig,
                 agree_all: Callable[[bool], bool] = bool, grammars: GrammarCache | None = None) -> None:
        """``agree_all``: on a TP node, whether every rank's check of its own share of an arrived
        room passed (each rank holds other KV heads); the identity on one rank."""
        self.engine, self.memory, self.receivers, self.aux = engine, memory, receivers, aux
        self.agree_all = agree_all
        self.grammars = grammars  # None: structured outputs off (such requests get a 400)
        self.stop, self.budget, self.ratio, self.cfg = stop, budget, ratio, cfg
        self.queues = DecodeQueues()
        self.counters = DecodeCounters()
        self.outbox: list[ReqOutput] = []  # this step's outputs, handed out by step()
        self._first_token: list[DecodeReq] = []  # KV landed (or computed here) this step: first token goes out with it
        self._deferred = False  # the last step skipped its forward to stream first tokens at once

    # ---- one step -------------------------------------------------------------------------------

    def step(self, msgs: Sequence[WorkItem] = ()) -> list[ReqOutput]:
        for msg in msgs:
            if isinstance(msg, GenerateReq):
                self._arrive(msg)
            else:
                self._abort(msg.rid, "aborted")
        if not self.queues.reqs:
            self.ratio.reset()
        self._poll_draining()
        self._poll_transfer()
        self._resume_retracted()  # retracted first: they go before any new room
        self._poll_prealloc()
        self._merge_waiting()
        # A streamed first token leaves before this step's forward, not after it: the forward
        # would add a whole decode step to its time to first token. The loop turns at once (the
        # batch is runnable) and the next step runs the forward, never deferred twice in a row.
        if self._deferred or not any(r.stream for r in self._first_token):
            self._decode()
            self._deferred = False
        else:
            self._deferred = True
        now = time.time()
        for r in self._first_token:  # their first token leaves with this step's outputs
            r.clock.lap("first_token", now)
        self._first_token.clear()
        out, self.outbox = self.outbox, []
        return out

    def runnable(self) -> bool:
        """A forward to run: the loop should turn without waiting for input."""
        return bool(self.queues.running or self.queues.waiting)

    def idle(self) -> bool:
        """Nothing in flight, no room draining: the loop may wait longest for input."""
        return not (self.queues.reqs or self.queues.draining)

    # ---- input ----------------------------------------------------------------------------------

    def _arrive(self, msg: GenerateReq) -> None:
        local = msg.bootstrap_room is None
        addr = None
        if not local and msg.bootstrap_host is not None and msg.bootstrap_port is not None:
            addr = f"{msg.bootstrap_host}:{msg.bootstrap_port}"
        r = DecodeReq(rid=msg.rid, prompt=list(msg.input_ids), params=msg.sampling, stream=msg.stream,
                      room=msg.bootstrap_room, bootstrap_addr=addr, arrival=msg.arrival_time or time.time())
        if msg.rid in self.queues.reqs:
            return self._refuse(r, f"request id {msg.rid!r} is already running on this decode node")
        if self.budget.pages(len(r.prompt) + 1) > self.budget.cfg.total_pages:
            return self._refuse(r, f"{r.label()}: a prompt of {len(r.prompt)} tokens does not fit this decode "
                                   f"node's KV pool ({self.budget.cfg.total_pages * self.budget.cfg.page_size} tokens)")
        if local and r.max_new == 0:
            r.finish = FinishReason(type="length", length=0)
            return self._emit(r)
        spec = spec_of(msg.sampling)
        if spec is not None:
            if self.grammars is None:
                return self._refuse(r, f"{r.label()}: structured outputs (json_schema, regex, ebnf) are off on this node")
            r.grammar = GrammarState.start(self.grammars, spec)  # compiles while the KV transfers
        if local:
            r.stage = Stage.RETRACTED
            self.queues.retracted.append(r)
        else:
            if msg.bootstrap_host is None or msg.bootstrap_port is None:  # no prefill we could tell
                return self._fail(r, 400, f"{r.label()}: bootstrap_room without bootstrap_host/bootstrap_port")
            try:
                r.receiver = self.receivers.create_receiver(r.room, r.bootstrap_addr)  # type: ignore[arg-type]
            except TransferError as exc:
                status = 409 if isinstance(exc, RoomInUse) else 400
                return self._fail(r, status, f"{r.label()}: cannot receive its KV: {exc}")
            self.queues.prealloc.append(r)
        self.queues.reqs[r.rid] = r

    def _abort(self, rid: str, reason: str, http_status: int | None = None) -> None:
        """Answer at once; free what is ours now, fence what the prefill may still write.
        With ``http_status`` the answer is an error (e.g. 500 when the step itself failed)."""
        r = self.queues.reqs.pop(rid, None)
        if r is None:
            return  # finished already, or never here
        self.counters.aborted += 1
        r.finish = FinishReason(type="abort", message=reason)
        if http_status is not None:
            r.error, r.http_status = reason, http_status
        self._emit(r)
        self.queues.remove(r)
        if r.stage in (Stage.PREALLOC, Stage.TRANSFER):
            assert r.receiver is not None
            # Draining first: whatever abort() does, the room is still polled to its end and
            # its pages freed once (the transfer layer's own timeouts end it in any case).
            r.stage, r.drain_since = Stage.DRAINING, time.monotonic()
            self.queues.draining.append(r)
            try:
                r.receiver.abort(f"{r.label()}: {reason}")
            except Exception:
                log.exception("%s: aborting its transfer failed", r.label())
        else:
            r.release(self.memory, self.aux)

    # ---- draining -> transfer -------------------------------------------------------------------

    def _poll_draining(self) -> None:
        """Free the memory of answered rooms once no write of their prefill can land."""
        now = time.monotonic()
        for r in list(self.queues.draining):
            assert r.receiver is not None
            if r.receiver.poll().terminal and not r.receiver.fenced():
                self.queues.draining.remove(r)
                r.release(self.memory, self.aux)
                r.stage = Stage.DONE
            elif now - r.drain_since > self.cfg.drain_warn_s:
                what = "its prefill may still write (pages fenced)" if r.receiver.fenced() else "its transfer has not ended yet"
                log.warning("%s: answered %.0f s ago, %s", r.label(), now - r.drain_since, what)
                r.drain_since = now

    def _poll_transfer(self) -> None:
        for r in list(self.queues.transfer):
            assert r.receiver is not None and r.kv is not None and r.aux_slot is not None
            status = r.receiver.poll()
            if status is KVPoll.Failed:
                self._fail(r, 503, f"{r.label()}: KV transfer failed: {r.receiver.failure_reason}")
            elif status is KVPoll.Success:
                rec = self.aux.read(r.aux_slot)
                room_ok = not self.cfg.check_aux_room or rec.room == r.room
                # From a prefill of another TP size our pages hold other head ranges than the
                # digest covers: the arrival check cannot apply (docs/TRANSFER.md, "Unequal TP").
                # Only the pages past our cached prefix arrived; the prefix was checked at reuse.
                reused = r.kv.num_cached
                intact = room_ok and (r.receiver.resharded or
                                      self.memory.arrived_intact(r.kv, len(r.prompt), rec.kv_digest, reused))
                if not self.agree_all(intact):  # every TP rank checks its own heads: one bad share fails all
                    if not room_ok:
                        self._fail(r, 500, f"{r.label()}: the aux row holds room {rec.room}, not ours")
                        continue
                    # Not the KV the prefill computed (a write through the data plane, or a
                    # corrupted transfer): never decode from it. 502: the router may retry.
                    why = ("the prefill sent no KV digest (run both roles with the same PDC_KV_INTEGRITY)"
                           if not rec.kv_digest else "the pages that arrived differ from what the prefill computed"
                           if not intact else "another TP rank of this node found its share changed")
                    self._fail(r, 502, f"{r.label()}: KV integrity check failed: {why} (see /metrics "
                                       "pdc_scheduler_kv_integrity_failures_total)")
                    continue
                if r.receiver.resharded and self.memory.cache.enabled:
                    # No digest covers our heads' share: trusted as it landed, and recorded so a
                    # later reuse still notices a write after this point.
                    self.memory.written(r.kv, reused, len(r.prompt), final=False)
                self.aux.free(r.aux_slot)
                r.aux_slot, r.receiver = None, None
                r.kv.kv_len = len(r.prompt)
                self.counters.transferred_tokens += len(r.prompt) - reused
                self.counters.reused_tokens += reused
                self.counters.transferred_pages += self.memory.pages_for(len(r.prompt)) - reused // self.memory.page_size
                r.cached_tokens, r.reused_tokens = rec.cached_tokens, reused
                self.queues.transfer.remove(r)
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
                    self.queues.waiting.append(r)

    # ---- retracted -> running -------------------------------------------------------------------

    def _resume_retracted(self) -> None:
        q = self.queues
        budget_left = self.cfg.recompute_tokens_per_step
        while q.retracted and budget_left > 0 and len(q.running) < self.cfg.max_running_requests:
            r = q.retracted[0]
            if not r.grammar_ready(time.monotonic()):
                return  # a local request's grammar is compiling (a resumed one's is ready long since)
            if r.finish is not None:  # its grammar failed while it waited
                q.retracted.popleft()
                self._finish(r)
                continue
            ids = r.recompute_ids()
            others = [o.holder() for o in (*q.running, *q.waiting, *q.transfer)]
            if not self.budget.can_resume(r.holder(), self.memory.available_pages(), others, self.ratio.value,
                                          alone=not (q.running or q.waiting)):
                return
            # With the prefix cache on, the longest cached prefix is locked and only the rest is
            # computed: a resumed request finds the prefix it reused at prealloc if it was not
            # evicted meanwhile (its own pages were freed), and a local request (routed here
            # because this node holds its conversation, router --decode-local-prefill-tokens)
            # computes only its new suffix.
            kv = self.memory.admit(ids, use_cache=self.memory.cache.enabled)
            if kv is None:
                return
            if not self.memory.reserve(kv, len(ids)):
                self.memory.release(kv, None)
                return
            q.retracted.popleft()
            r.kv = kv
            reused = kv.num_cached
            if r.room is None and not r.out:  # a local request's prompt: what it reused and computed
                r.cached_tokens = r.reused_tokens = reused
                r.computed_tokens = len(ids) - reused
                self.counters.reused_tokens += reused
                self.counters.local_prefill_tokens += len(ids) - reused
            first = recompute(self.engine, r, ids, self.cfg.recompute_tokens_per_step)
            if first is not None:
                r.clock.lap("local_prefill")  # arrival -> its prompt computed (the wait for a turn included)
            if self.memory.cache.enabled:  # digests of the full pages, checked before the cache serves them
                self.memory.written(kv, reused, len(ids), final=False)
            budget_left -= len(ids) - reused
            if first is not None:  # a local request's first token: out before this step's forward, as a room's
                self._first_token.append(r)
                self._append(r, first.token_id, first.logprob, first.top_logprobs)
            self._to_running_or_finish(r)

    # ---- prealloc -> transfer -> waiting -> running ---------------------------------------------

    def _poll_prealloc(self) -> None:
        q = self.queues
        if not q.prealloc:
            return
        ratio = self.ratio.value
        alloc = retractable = 0
        budgeted = False  # the budget needs every request's view: built only once a room is ready
        blocked = False  # FIFO: once one room does not fit, later ones wait too (no starvation)
        for r in list(q.prealloc):
            assert r.receiver is not None
            status = r.receiver.poll()
            if status is KVPoll.Failed:
                self._fail(r, 503, f"{r.label()}: KV transfer failed before it started: {r.receiver.failure_reason}")
                continue
            if status is not KVPoll.WaitingForInput or blocked:
                continue
            if not budgeted:
                held = [h.holder() for h in q.running]
                alloc = self.budget.allocatable_pages(
                    self.memory.available_pages(), held, [h.holder() for h in (*q.transfer, *q.waiting)],
                    [h.holder() for h in q.retracted], ratio)
                retractable = sum(h.held_pages for h in held)
                budgeted = True
            if not self.budget.can_prealloc(len(r.prompt), r.max_new, alloc, retractable, ratio) or not r.reserve_room(self.memory, self.aux):
                blocked = True
                continue
            alloc -= self.budget.pages(len(r.prompt) + self.budget.headroom_tokens(r.steps_left, ratio))
            q.prealloc.remove(r)
            r.stage = Stage.TRANSFER
            q.transfer.append(r)
            assert r.kv is not None and r.receiver is not None
            state = [r.kv.state_slot] if r.kv.state_slot is not None else []
            # The prefill writes only the pages past our cached prefix (decode_prefix_len).
            reused = r.kv.num_cached
            r.receiver.init(r.kv.pages[reused // self.memory.page_size :], r.aux_slot, state, prompt_digest(r.prompt),
                            decode_prefix_len=reused)
            r.clock.lap("prealloc")

    def _merge_waiting(self) -> None:
        """The prebuilt batch: KV in place, first token from the prefill: running needs no forward.
        A request whose grammar still compiles stays (with its pages) and the others go past it."""
        q = self.queues
        now = time.monotonic()
        for r in list(q.waiting):
            if len(q.running) >= self.cfg.max_running_requests:
                break
            if r.grammar_ready(now):  # the matcher has now seen the prefill's first token
                q.waiting.remove(r)
                self._to_running_or_finish(r)

    def _to_running_or_finish(self, r: DecodeReq) -> None:
        if r.finish is not None:
            return self._finish(r)
        r.stage = Stage.RUNNING
        self.queues.running.append(r)
        if r.stream:
            self._emit(r)

    # ---- decode ---------------------------------------------------------------------------------

    def _decode(self) -> None:
        running = self.queues.running
        if not running or not self._make_room():
            return
        for r in running:
            assert r.kv is not None
            if not self.memory.reserve(r.kv, r.kv.kv_len + 1):
                raise RuntimeError(f"{r.label()}: no page after _make_room said it fits")  # a budget bug
        batch = list(running)
        items = [DecodeItem(r.kv.row, r.out[-1], r.kv.kv_len) for r in batch if r.kv is not None]
        specs = [r.sample_spec() for r in batch]
        t0 = time.perf_counter()
        tokens = self.engine.run_decode(items, specs)
        # Step counters split decode time into model time and everything around it (bench, /metrics).
        self.counters.decode_forward_seconds += time.perf_counter() - t0
        self.counters.decode_steps += 1
        self.counters.decode_batch_reqs += len(items)
        if self.cfg.fault_step_delay_s > 0:
            time.sleep(self.cfg.fault_step_delay_s)
        self.ratio.on_decode_step()
        digest_pages = self.memory.cache.enabled and self.memory.digests is not None
        for r, tok in zip(batch, tokens):
            assert r.kv is not None
            r.kv.kv_len += 1
            if digest_pages and r.kv.kv_len % self.memory.page_size == 0:
                # A page just filled: its digest, checked before the prefix cache serves it again.
                self.memory.written(r.kv, r.kv.kv_len - 1, r.kv.kv_len, final=False)
            self._append(r, tok.token_id, tok.logprob, tok.top_logprobs)
            if r.finish is not None:
                running.remove(r)
                self._finish(r)
            elif r.stream and len(r.out) - r.sent >= self.cfg.stream_interval:
                self._emit(r)

    def _make_room(self) -> bool:
        """Ensure every running request can take its next page; False: skip this decode step."""
        q = self.queues
        # The common case, checked without the budget's view of every request: each next token fits
        # in its own pages or the free ones (at least as strict as the budget's own first check).
        pages_for = self.memory.pages_for
        need = sum(max(0, pages_for(r.kv.kv_len + 1) - len(r.kv.pages)) for r in q.running if r.kv is not None)
        if need <= self.memory.available_pages():
            return True
        victims, fits = self.budget.pick_victims([r.holder() for r in q.running], self.memory.available_pages())
        chosen = [q.running[i] for i in victims]
        for r in chosen:
            self._retract(r)
        if chosen:
            self.ratio.on_retract([r.holder() for r in q.running], self.budget.cfg.retract_decode_steps)
            log.info("retracted %d request(s) (%s); new_token_ratio now %.3f", len(chosen),
                     ", ".join(r.rid for r in chosen), self.ratio.value)
        while not fits and q.waiting:
            # Requests waiting for a running slot hold pages too (only with a full running batch).
            self._retract(q.waiting[-1])
            fits = self.budget.step_pages(q.running[0].holder()) <= self.memory.available_pages()
        if fits:
            return True
        if q.transfer or any(r.kv is not None and not (r.receiver and r.receiver.fenced()) for r in q.draining):
            # Rooms in transfer hold pages that can be retracted once they land, and aborted rooms
            # still draining hold pages that come back once the prefill answers: wait for them
            # rather than fail the request with a false "out of KV memory". Fenced rooms may never
            # come back (a peer that never returns): not worth waiting for.
            return False
        # One request alone outgrows the whole pool (its worst case was capped at admission).
        [r] = q.running
        self._fail(r, 500, f"{r.label()}: out of KV memory: {len(r.prompt) + len(r.out)} tokens exceed this "
                           f"decode node's pool ({self.budget.cfg.total_pages * self.budget.cfg.page_size} tokens)")
        return False

    def _retract(self, r: DecodeReq) -> None:
        self.queues.remove(r)
        r.release(self.memory, self.aux)
        r.retractions += 1
        self.counters.retractions += 1
        r.stage = Stage.RETRACTED
        self.queues.retracted.append(r)

    def _append(self, r: DecodeReq, token: int, logprob: float | None, top: Sequence[tuple[int, float]]) -> None:
        r.append(token, logprob, top, self.stop)
        self.counters.generated_tokens += 1
        if r.grammar is not None:
            r.grammar_ready(time.monotonic())  # advance the matcher; may finish the request

    # ---- endings --------------------------------------------------------------------------------

    def _finish(self, r: DecodeReq) -> None:
        r.release(self.memory, self.aux, cache=True)  # its KV is whole: prompt + output may serve the next turn
        self.queues.reqs.pop(r.rid, None)
        r.stage = Stage.DONE
        self.counters.finished += 1
        self._emit(r)

    def _fail(self, r: DecodeReq, status: int, message: str) -> None:
        """Finish with an error; only for rooms whose receiver is terminal (or never created).
        A fenced receiver's memory goes to ``draining`` instead of back to the pools."""
        log.warning("%s", message)
        self.queues.remove(r)
        if r.receiver is not None and r.receiver.fenced():
            r.stage, r.drain_since = Stage.DRAINING, time.monotonic()
            self.queues.draining.append(r)
        else:
            r.release(self.memory, self.aux)
            r.stage = Stage.DONE
        if self.queues.reqs.get(r.rid) is r:  # a rejected duplicate must not drop the live request
            del self.queues.reqs[r.rid]
        self.counters.failed += 1
        r.finish, r.error, r.http_status = FinishReason(type="abort", message=message), message, status
        self._emit(r)

    def _refuse(self, r: DecodeReq, message: str) -> None:
        """Reject a request that got no receiver (400) and tell its prefill, whose sender would
        otherwise wait for our TransferInfo until its bootstrap timeout (and a router waiting for
        both answers would hold the client's 400 that long). The transfer layer leaves a room
        that is live here alone: it belongs to another request."""
        self._fail(r, 400, message)
        if r.room is not None and r.bootstrap_addr is not None:
            try:
                self.receivers.reject_room(r.room, r.bootstrap_addr, message)
            except Exception:  # telling the prefill is best effort; its timeout still ends the room
                log.exception("%s: could not tell the prefill it was refused", r.label())

    def _emit(self, r: DecodeReq) -> None:
        if r.finish is not None or r.stream:  # non-streaming requests: only the final output
            self.outbox.append(r.take_output())

    # ---- after an internal error, and invariants ---------------------------------------------

    def fail_all(self, reason: str) -> list[ReqOutput]:
        """After an exception escaped a step: answer every live request with a 500 and release
        what it holds (rooms whose prefill may still write drain first)."""
        for rid in list(self.queues.reqs):
            self._abort(rid, reason, http_status=500)
        out, self.outbox = self.outbox, []
        return out

    def check_integrity(self) -> None:
        self.queues.check_integrity(self.memory, self.aux)


def recompute(engine: Engine, r: DecodeReq, ids: Sequence[int], chunk: int) -> SampledToken | None:
    """Write the KV of ``ids`` past the row's cached prefix (``r.kv.num_cached``, whose KV is
    there) into ``r``'s row, ``chunk`` tokens per forward (a resumed request's recompute); a
    request with no output yet samples its first token from the last chunk."""
    assert r.kv is not None and r.kv.num_cached < len(ids)
    chunk = max(chunk, 1)
    sampled: SampledToken | None = None
    for start in range(r.kv.num_cached, len(ids), chunk):
        end = min(start + chunk, len(ids))
        first = end == len(ids) and not r.out
        spec = SampleSpec(r.params, r.out, r.prompt, r.grammar.matcher if r.grammar else None) if first else None
        [sampled] = engine.run_extend([ExtendChunk(r.kv.row, ids[start:end], start)], [spec])
    r.kv.kv_len = len(ids)
    return sampled
