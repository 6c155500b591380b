"""The prefill scheduler: plain data in (API messages), plain data out (replies), one ``step`` at a time.

Lifecycle of one request (queues are FIFO lists; every arrow happens inside ``step``)::

    GenerateReq --receive--> bootstrap --poll: WaitingForInput--> waiting
      bad input: 400 reply      sender created; the decode          |  prefill adder: budgets + policy;
      (no pool touched)         has not said where to write yet     |  admit = row + cached prefix +
                                                                    v  pages for the whole prompt
                             chunked <--more prompt left-------- forward
                             (goes first next step)                 |  every chunk: its finished pages
                                                                    |  -> sender.send (non-blocking)
                                                                    |  last chunk: first token sampled,
                                                                    v  aux (token, logprobs, cached) too
                                                                 inflight --poll: Success/Failed--> release, reply
                                                                    (no terminal state within
                                                                     transfer_timeout_s: sender.abort)

    Failed seen in bootstrap / waiting / chunked       -> released and answered at once (503)
    AbortReq, forward error, send error in any queue   -> sender.abort -> inflight -> released when terminal

Queue bookkeeping, the single release and the per-request error guard live in
``prefill_node.queues``. Why release waits for a terminal state: the KVSender contract reports Failed only once no write
of the room is in flight, so after Success/Failed nothing reads the pages any more. Then, and only
then, the prompt's full pages go to the radix cache (``KVMemory.release`` with the token ids): an
insert may free a duplicate page, which must not happen while a transfer still reads it. Every
request is released exactly once (``_finish`` marks it); ``check_integrity`` proves it.

A local request (no ``bootstrap_room``: ``/health_generate``) skips bootstrap and transfer: it
runs its prompt and is answered with the one token sampled, so liveness checks exercise the model.

The scheduler never blocks: ``sender.poll`` is a dict read, ``sender.send`` queues work for the
transfer threads. It is not thread-safe; the scheduler process loop owns it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


from common.engine.driver import SampleSpec
from common.engine.model_runner import ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.req_kv import KVMemory
from common.ipc.protocol import AbortReq, GenerateReq, ReqOutput
from common.request import FinishReason
from prefill_node.adder import Policy, PrefillAdder, PrefillBudget, order_waiting
from common.sched.stop import StopChecker
from prefill_node.queues import PrefillQueues
from prefill_node.req import PrefillReq, aux_record, failed, local_answer
from transfer.base import KVSender
from transfer.errors import TransferError
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


class ExtendEngine(Protocol):
    """``common.engine.driver.EngineDriver`` fits: one forward over prompt chunks, sampled tokens out."""

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]: ...


SenderFactory = Callable[[int], KVSender]  # PrefillKVManager.create_sender; raises TransferError


@dataclass(frozen=True)
class PrefillSchedConfig:
    budget: PrefillBudget
    policy: Policy = "fcfs"
    transfer_timeout_s: float = 60.0  # inflight without a terminal state this long -> abort the room
    aux_top_k: int = 0  # top logprobs carried in the aux record (must match the transfer layout)
    # The model's context length: a prompt this long leaves no room for a token (the API's rule).
    # None: only the request row (the context length rounded up to whole pages) bounds it.
    context_len: int | None = None


class PrefillScheduler(PrefillQueues):
    def __init__(self, engine: ExtendEngine, memory: KVMemory, senders: SenderFactory, stop: StopChecker,
                 cfg: PrefillSchedConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(memory, cfg.transfer_timeout_s, clock)
        self.engine, self.senders, self.stop, self.cfg = engine, senders, stop, cfg
        self.stalled = False  # the last step ran no forward although requests were waiting

    # ---- one step ------------------------------------------------------------------------------

    def step(self, incoming: Sequence[GenerateReq | AbortReq] = ()) -> list[ReqOutput]:
        out: list[ReqOutput] = []
        for msg in incoming:
            try:
                if isinstance(msg, GenerateReq):
                    self._receive(msg, out)
                elif msg.rid in self.reqs:
                    self._drain(self.reqs[msg.rid], "aborted by the client", None, out)
            except Exception as exc:  # one bad message must not lose the others
                req = self.reqs.get(msg.rid)
                if req is not None:
                    self._request_error(req, "receive", exc, out)
                elif isinstance(msg, GenerateReq):
                    log.exception("rid %s: could not take the request", msg.rid)
                    out.append(failed(msg.rid, f"rid {msg.rid}: internal error: {type(exc).__name__}: {exc}", 500))
        self._poll_bootstrap(out)
        self._drop_failed(out)
        # Finished transfers release before scheduling so this step's batch can use their pages
        # (a chunk sent by this step's forward is polled from the next step on).
        self._poll_inflight(out)
        batch = self._schedule(out)
        # Waiting requests that did not fit wait for a transfer to finish: no reason to spin.
        self.stalled = not batch
        if batch:
            self._forward(batch, out)
        return out

    def has_runnable(self) -> bool:
        """A forward is likely next step (else the loop may wait on its socket a little)."""
        return self.chunked is not None or (bool(self.waiting) and not self.stalled)

    # ---- receive -------------------------------------------------------------------------------

    def _receive(self, msg: GenerateReq, out: list[ReqOutput]) -> None:
        if msg.rid in self.reqs:  # the API never does this; a reply would reach the other request
            log.error("dropping a second request with the in-flight rid %s", msg.rid)
            return
        where = f"rid {msg.rid}" if msg.bootstrap_room is None else f"room {msg.bootstrap_room} (rid {msg.rid})"
        error = self._check_input(msg)
        sender = None
        if msg.bootstrap_room is not None:
            try:
                sender = self.senders(msg.bootstrap_room)
            except TransferError as exc:  # the room is another live request's: leave it alone
                error = error or str(exc)
        if error is not None and sender is None:
            self.counters.rejected += 1
            out.append(failed(msg.rid, f"{where}: {error}", 400, len(msg.input_ids)))
            return
        req = PrefillReq(msg.rid, msg.bootstrap_room, list(msg.input_ids), msg.sampling, sender)
        self.reqs[req.rid] = req
        if error is not None:
            # The decode holds pages for this room and waits for its KV: abort the room so it
            # hears why now (or at its TransferInfo, from the tombstone) instead of at its
            # timeout. The 400 goes out once the room is terminal, normally this same step.
            self._drain(req, error, 400, out)
            return
        (self.waiting if sender is None else self.bootstrap).append(req)

    def _check_input(self, msg: GenerateReq) -> str | None:
        """Why the request can never run here (400), or None. Touches no pool."""
        n = len(msg.input_ids)
        if n == 0:
            return "empty prompt"
        ctx = self.cfg.context_len
        if ctx is not None and n >= ctx:
            return f"prompt of {n} tokens does not fit the context length {ctx} (at least one token must follow)"
        if n > self.memory.req_to_token.max_context_len:
            return f"prompt of {n} tokens exceeds the context length {self.memory.req_to_token.max_context_len}"
        pages, total = self.memory.pages_for(n), self.memory.allocator.num_total
        if pages > total:
            return f"prompt of {n} tokens needs {pages} KV pages; this node has {total}"
        if msg.bootstrap_room is None and msg.sampling.max_new_tokens > 1:
            return ("a prefill node generates no text: send disaggregated requests (bootstrap_host/port/room) "
                    "through the router, or max_new_tokens <= 1 for a local check")
        return None

    # ---- queues before the forward -----------------------------------------------------------

    # Every queue pass below takes the whole queue first and puts each request where it belongs
    # as it goes, inside a per-request guard: an exception for one request fails that request
    # alone (``_request_error``) and can neither drop the others nor leave one in two places.

    def _poll_bootstrap(self, out: list[ReqOutput]) -> None:
        pending, self.bootstrap = self.bootstrap, []
        for req in pending:
            with self._guard(req, "bootstrap poll", out):
                state = req.sender.poll()  # type: ignore[union-attr]  # bootstrap requests have senders
                if state is KVPoll.Bootstrapping:
                    self.bootstrap.append(req)
                elif state is KVPoll.Failed:
                    self._finish_transfer(req, state, out)
                else:  # WaitingForInput: the decode said where to write
                    req.clock.lap("bootstrap")
                    self.waiting.append(req)

    def _drop_failed(self, out: list[ReqOutput]) -> None:
        """A room can fail before its forward (decode gave up, aborted, was refused): free it now."""
        pending, self.waiting = self.waiting, []
        for req in pending:
            with self._guard(req, "waiting poll", out):
                if req.sender is not None and req.sender.poll() is KVPoll.Failed:
                    self._finish_transfer(req, KVPoll.Failed, out)
                else:
                    self.waiting.append(req)
        req = self.chunked
        if req is not None and req.sender is not None:
            with self._guard(req, "chunked poll", out):
                if req.sender.poll() is KVPoll.Failed:
                    self.chunked = None
                    self._finish_transfer(req, KVPoll.Failed, out)

    def _schedule(self, out: list[ReqOutput]) -> list[tuple[PrefillReq, int]]:
        """This step's batch: (request, tokens to compute) — the chunked request first."""
        mem = self.memory
        adder = PrefillAdder(self.cfg.budget, mem.available_pages(), mem.page_size)
        batch: list[tuple[PrefillReq, int]] = []
        if self.chunked is not None:
            batch.append((self.chunked, adder.add_chunked(self.chunked.prompt_len - self.chunked.computed)))
        if adder.closed or not self.waiting:
            return batch

        # Cached prefix lengths, read without touching the cache: most waiting requests are not
        # admitted this step, and stamping their prefixes every step would distort LRU eviction.
        # Evictions during this step only shorten prefixes; admission re-checks with the real match.
        peeked: dict[str, int] = {}

        def prefix_len(r: PrefillReq) -> int:
            if r.rid not in peeked:
                peeked[r.rid] = mem.cache.peek_prefix_len(r.input_ids, r.prompt_len - 1)
            return peeked[r.rid]

        for req in order_waiting(self.waiting, self.cfg.policy, prefix_len):
            try:
                n = self._admit(req, adder, prefix_len(req))
            except Exception as exc:  # the adder may be half-updated: stop adding this step
                self._request_error(req, "admission", exc, out)
                break
            if n is None:
                break
            batch.append((req, n))
            if adder.closed:
                break
        return batch

    def _admit(self, req: PrefillReq, adder: PrefillAdder, cached_guess: int) -> int | None:
        """Row + cached prefix + pages for the whole prompt, all or nothing; the request leaves
        ``waiting`` holding them. Tokens to compute this step, or None (does not fit: stop).
        ``cached_guess`` (a read-only peek, >= the real match) rules out a request that cannot
        fit before its prefix is matched and locked, which would mark it recently used."""
        mem = self.memory
        if not adder.can_add(req.prompt_len, cached_guess):
            return None
        before = mem.available_pages()
        kv = mem.admit(req.input_ids)  # locks the cached prefix
        if kv is None:
            return None  # no request row free
        try:
            n = adder.add_new(req.prompt_len, kv.num_cached, lock_pages=before - mem.available_pages())
            fits = n is not None and mem.reserve(kv, req.prompt_len)
        except BaseException:
            mem.release(kv, None)
            raise
        if not fits:
            mem.release(kv, None)  # unlock; nothing was computed
            return None
        self.waiting.remove(req)
        req.kv = kv
        return n

    # ---- forward and send ----------------------------------------------------------------------

    def _forward(self, batch: list[tuple[PrefillReq, int]], out: list[ReqOutput]) -> None:
        chunks: list[ExtendChunk] = []
        specs: list[SampleSpec | None] = []
        for req, n in batch:
            assert req.kv is not None
            start = req.kv.kv_len
            chunks.append(ExtendChunk(req.kv.row, req.input_ids[start : start + n], start))
            last = start + n == req.prompt_len
            specs.append(SampleSpec(req.params, (), req.input_ids) if last else None)
        t0 = self.clock()
        wall = time.time()
        for req, _ in batch:
            req.clock.lap("queue", wall)  # waiting (and, between chunks, waiting for the next turn)
        self.chunked = None
        try:
            results = self.engine.run_extend(chunks, specs)
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except Exception as exc:  # a bad batch fails its requests; the node keeps serving
            log.exception("prefill forward of %d requests failed", len(batch))
            for req, _ in batch:
                self._request_error(req, None, f"prefill forward failed: {type(exc).__name__}: {exc}", out)
            return
        now = self.clock()
        self.counters.forwards += 1
        self.counters.forward_s += now - t0
        wall = time.time()
        for req, _ in batch:
            req.clock.lap("forward", wall)
            req.clock.forwards += 1
        for (req, n), tok in zip(batch, results):  # each request is in no queue until placed here
            with self._guard(req, "after the forward", out):
                assert req.kv is not None
                if req.kv.kv_len == req.kv.num_cached:
                    self.counters.cached_tokens += req.kv.num_cached
                req.kv.kv_len += n
                self.counters.prompt_tokens += n
                last = req.kv.kv_len == req.prompt_len
                req.first = tok if last else None
                if req.sender is not None and not self._send(req, last, out):
                    continue  # drained by a send error
                if not last:
                    self.chunked = req
                elif req.sender is None:
                    self._finish(req, local_answer(req, self._local_finish(req)), out)
                else:
                    req.drain_since = now
                    self.inflight.append(req)

    def _send(self, req: PrefillReq, last: bool, out: list[ReqOutput]) -> bool:
        """Hand the chunk's finished pages to the sender. An intermediate chunk sends full pages
        only; a page it filled partly goes with the next chunk::

            page_size 4, chunk ends at token 10:  |0 1 2 3|4 5 6 7|8 9 . .|  -> sends pages 0, 1
            last chunk (prompt of 13 tokens):      ... |8 9 10 11|12 . . .|  -> sends pages 2, 3
        """
        kv = req.kv
        assert kv is not None and req.sender is not None
        upto = len(kv.pages) if last else kv.kv_len // self.memory.page_size
        pages = kv.pages[req.sent_pages : upto]
        if not pages and not last:
            return True
        aux = aux_record(req, req.first, self.cfg.aux_top_k) if last and req.first is not None else None
        try:
            # A hybrid model's recurrent state is final only after the last chunk; it goes with it.
            state = [req.kv.state_slot] if last and req.kv.state_slot is not None else []
            req.sender.send(pages, last, aux, state)
        except Exception as exc:  # TransferError, or a bug: either way only this request fails
            if not isinstance(exc, TransferError):
                log.exception("%s: KV send raised", req.name())
            self._drain(req, f"KV send failed: {exc}", 500, out)
            return False
        req.sent_pages = upto
        return True

    def _local_finish(self, req: PrefillReq) -> FinishReason:
        if req.params.max_new_tokens == 0:
            req.first = None
            return FinishReason(type="length", length=0)
        assert req.first is not None
        return self.stop.check(req.params, [req.first.token_id]) or FinishReason(type="length", length=1)

    # ---- after the forward ---------------------------------------------------------------------

    def _poll_inflight(self, out: list[ReqOutput]) -> None:
        now = self.clock()
        pending, self.inflight = self.inflight, []
        for req in pending:
            with self._guard(req, "transfer poll", out):
                assert req.sender is not None and req.drain_since is not None
                state = req.sender.poll()
                if state.terminal:
                    self._finish_transfer(req, state, out)
                    continue
                self.inflight.append(req)
                if now - req.drain_since > self.cfg.transfer_timeout_s:
                    # abort is idempotent; poll reports Failed once no write for the room is in flight.
                    req.sender.abort(f"KV transfer not done within {self.cfg.transfer_timeout_s:g} s")
