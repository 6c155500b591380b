"""The prefill scheduler: plain data in (API messages), plain data out (replies), one ``step`` at a time.

Lifecycle of one request (queues are FIFO lists in ``PrefillQueues``; every arrow happens inside ``step``)::

    GenerateReq --receive--> bootstrap --poll: WaitingForInput--> waiting
      bad input: 400 reply      sender created; the decode   |               |  prefill adder: budgets + policy;
      (no pool touched)         has not said where to write  | computed      |  admit = row + cached prefix +
                                yet                          | ahead         v  pages for the whole prompt
                                                             +-----------> forward <-- chunked (more prompt
                                                                             |          left; goes first
                                                                             |          next step)
                                                                             |  every chunk: its finished pages
                                                                             |  -> sender.send (non-blocking)
                                                                             |  last chunk: first token sampled,
                                                                             v  aux (token, logprobs, cached,
                                                                                the KV's digest) too
                             parked --poll: WaitingForInput--> inflight --poll: Success/Failed--> release, reply
        (computed ahead; the decode has     send it all         (no terminal state within
         not said where to write yet)                            transfer_timeout_s: sender.abort)

    Computing ahead (``ahead_pages`` > 0): once every waiting request that fits is in the batch,
    requests still in ``bootstrap`` join it in arrival order, while the pages held by requests
    computed ahead stay within ``ahead_pages``. The decode's pre-allocation and the prefill's
    forward then overlap instead of following each other. Such a request sends nothing until its
    room leaves Bootstrapping (the decode's page list and its own cached prefix come with it);
    then its next chunk, or ``parked``, sends everything computed so far. Waiting requests always
    go first, so computing ahead only fills room a forward would otherwise leave empty. The cap
    bounds what a slow decode can make this node hold, and leaves the rest of the pool to
    requests whose decode has answered: parked requests wait for decodes that may themselves wait
    for memory, so without it a full pool of them could hold back the prompts those decodes have
    already made room for, until bootstrap timeouts broke the cycle.

    Failed seen in bootstrap / waiting / chunked /
    parked                                             -> released and answered at once (503)
    grammar (json_schema / regex / ebnf)               -> compiled off the loop from arrival on; a waiting
                                                          request is admitted only once it is ready (the
                                                          batch runs without it meanwhile), and the last
                                                          chunk samples the first token under it; a compile
                                                          error or timeout ends it early (400)
    AbortReq, forward error, send error in any queue   -> _end_early: sender.abort -> inflight -> released when terminal

Why release waits for a terminal state: the KVSender contract reports Failed only once no write
of the room is in flight, so after Success/Failed nothing reads the pages any more. Only then do
the prompt's full pages go to the radix cache (``KVMemory.release`` with the token ids): an insert
may free a duplicate page, which must not happen while a transfer still reads it. Every request
leaves through ``_finish``: answered, and its KV released exactly once. An exception in one
request's handling fails it alone (``_guard``); ``fail_all`` is the net for one escaping a step.

A local request (no ``bootstrap_room``: ``/health_generate``) skips bootstrap and transfer: it
runs its prompt and is answered with the one token sampled, so liveness checks exercise the model.
The scheduler never blocks (``sender.poll`` is a dict read, ``sender.send`` queues work for the
transfer threads) and is not thread-safe: the node loop owns it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from common.engine.driver import SampleSpec
from common.engine.model_runner import ExtendChunk
from common.engine.sampler import SampledToken
from common.grammar.cache import GrammarCache
from common.grammar.spec import spec_of
from common.grammar.state import GrammarState
from common.ipc.protocol import GenerateReq, ReqOutput, WorkItem
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.request import FinishReason
from common.sched.stop import StopChecker
from common.timeline import PREFILL_STAGES
from prefill_node.admission import Policy, PrefillAdder, PrefillBudget, order_waiting
from prefill_node.ports import ExtendEngine, SenderFactory
from prefill_node.req import PrefillCounters, PrefillQueues, PrefillReq
from transfer.aux import AuxRecord
from transfer.errors import RoomInUse, TransferError
from transfer.messages import prompt_digest
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillSchedConfig:
    """The scheduler's view of the node's settings (built in ``PrefillPart.build_scheduler``;
    no defaults of its own: each setting is declared once, in ``common.config``)."""

    budget: PrefillBudget
    policy: Policy
    transfer_timeout_s: float  # inflight without a terminal state this long -> abort the room
    aux_top_k: int  # top logprobs carried in the aux record (must match the transfer layout)
    # The model's context length: a prompt this long leaves no room for a token (the API's rule).
    # None: only the request row (the context length rounded up to whole pages) bounds it.
    context_len: int | None
    # Most KV pages held by requests computed before their decode said where to write (the
    # module docstring); 0: a request waits for its decode before it is computed, as in SGLang.
    ahead_pages: int


class PrefillScheduler:
    def __init__(self, engine: ExtendEngine, memory: KVMemory, senders: SenderFactory, stop: StopChecker,
                 cfg: PrefillSchedConfig, clock: Callable[[], float] = time.monotonic,
                 grammars: GrammarCache | None = None) -> None:
        self.engine, self.memory, self.senders, self.stop, self.cfg, self.clock = engine, memory, senders, stop, cfg, clock
        self.grammars = grammars  # None: structured outputs off (such requests get a 400)
        self.queues = PrefillQueues()
        self.counters = PrefillCounters()
        self.outbox: list[ReqOutput] = []  # this step's replies, handed out by step()
        self.stalled = False  # the last step ran no forward although requests were waiting

    # ---- one step ------------------------------------------------------------------------------

    def step(self, msgs: Sequence[WorkItem] = ()) -> list[ReqOutput]:
        for msg in msgs:
            self._receive(msg)
        self._poll_bootstrap()
        self._drop_failed()
        # Finished transfers release before scheduling so this step's batch can use their pages
        # (a chunk sent by this step's forward is polled from the next step on).
        self._poll_inflight()
        batch = self._schedule()
        # Waiting requests that did not fit wait for a transfer to finish: no reason to spin.
        self.stalled = not batch
        if batch:
            self._forward(batch)
        out, self.outbox = self.outbox, []
        return out

    def runnable(self) -> bool:
        """A forward is likely next step (else the loop may wait on its socket a little)."""
        q = self.queues
        return q.chunked is not None or ((bool(q.waiting) or self._may_compute_ahead()) and not self.stalled)

    def _may_compute_ahead(self) -> bool:
        return bool(self.queues.bootstrap) and self.cfg.ahead_pages > 0

    def idle(self) -> bool:
        """Nothing in flight: the loop may wait longest for input."""
        return not self.queues.reqs

    # ---- receive -------------------------------------------------------------------------------

    def _receive(self, msg: WorkItem) -> None:
        req = self.queues.reqs.get(msg.rid)
        try:
            if isinstance(msg, GenerateReq):
                self._arrive(msg)
            elif req is not None:
                self._end_early(req, "aborted by the client", None)
        except Exception as exc:  # one bad message must not lose the others
            req = self.queues.reqs.get(msg.rid)
            if req is not None:
                self._request_error(req, "receive", exc)
            elif isinstance(msg, GenerateReq):
                log.exception("rid %s: could not take the request", msg.rid)
                self.outbox.append(failed(msg.rid, f"rid {msg.rid}: internal error: {type(exc).__name__}: {exc}", 500))

    def _arrive(self, msg: GenerateReq) -> None:
        if msg.rid in self.queues.reqs:  # the API never does this; a reply would reach the other request
            log.error("dropping a second request with the in-flight rid %s", msg.rid)
            return
        where = f"rid {msg.rid}" if msg.bootstrap_room is None else f"room {msg.bootstrap_room} (rid {msg.rid})"
        error = input_error(msg, self.memory, self.cfg.context_len)
        sender, status = None, 400
        if msg.bootstrap_room is not None:
            try:
                sender = self.senders(msg.bootstrap_room, prompt_digest=prompt_digest(msg.input_ids))
            except TransferError as exc:  # e.g. the room is another live request's: leave it alone
                if error is None:
                    error, status = str(exc), 409 if isinstance(exc, RoomInUse) else 400
        if error is not None and sender is None:
            self.counters.rejected += 1
            self.outbox.append(failed(msg.rid, f"{where}: {error}", status, len(msg.input_ids)))
            return
        req = PrefillReq(msg.rid, msg.bootstrap_room, list(msg.input_ids), msg.sampling, sender)
        if sender is not None:
            req.clock.order = PREFILL_STAGES
        spec = spec_of(msg.sampling)
        if error is None and spec is not None:
            if self.grammars is None:
                error = "structured outputs (json_schema, regex, ebnf) are off on this node"
            else:  # compiles while the room bootstraps
                req.grammar = GrammarState.start(self.grammars, spec, self.clock())
        self.queues.reqs[req.rid] = req
        if error is not None:
            # The decode holds pages for this room and waits for its KV: abort the room so it
            # hears why now (or at its TransferInfo, from the tombstone) instead of at its
            # timeout. The 400 goes out once the room is terminal, normally this same step.
            self._end_early(req, error, 400)
            return
        (self.queues.waiting if sender is None else self.queues.bootstrap).append(req)

    # ---- queues before the forward -----------------------------------------------------------

    # Every queue pass below takes the whole queue first and puts each request where it belongs
    # as it goes, inside a per-request guard: an exception for one request fails that request
    # alone (``_request_error``) and can neither drop the others nor leave one in two places.

    def _poll_bootstrap(self) -> None:
        q = self.queues
        pending, q.bootstrap = q.bootstrap, []
        self._poll_answers(pending, q.bootstrap, self._answered, "bootstrap poll")
        pending, q.parked = q.parked, []
        self._poll_answers(pending, q.parked, self._answered_parked, "parked poll")

    def _poll_answers(self, pending: list[PrefillReq], still: list[PrefillReq],
                      answered: Callable[[PrefillReq], None], where: str) -> None:
        """Requests waiting for their decode's answer: still Bootstrapping goes back to ``still``,
        Failed is released and answered, WaitingForInput (the decode said where to write) goes
        to ``answered``."""
        for req in pending:
            with self._guard(req, where):
                state = req.sender.poll()  # type: ignore[union-attr]  # these requests have senders
                if state is KVPoll.Bootstrapping:
                    still.append(req)
                elif state is KVPoll.Failed:
                    self._finish(req, room_ended(req, state))
                else:
                    answered(req)

    def _answered(self, req: PrefillReq) -> None:
        req.clock.lap("bootstrap")
        self.queues.waiting.append(req)

    def _answered_parked(self, req: PrefillReq) -> None:
        """Computed ahead: send it all now."""
        req.ahead = False
        req.clock.lap("bootstrap")  # computed, then waited this long for the decode
        if self._send(req, True):
            self.queues.park_inflight(req, self.clock())

    def _drop_failed(self) -> None:
        """A room can fail before its forward (decode gave up, aborted, was refused): free it now."""
        q = self.queues
        pending, q.waiting = q.waiting, []
        now = self.clock()
        for req in pending:
            with self._guard(req, "waiting poll"):
                if req.sender is not None and req.sender.poll() is KVPoll.Failed:
                    self._finish(req, room_ended(req, KVPoll.Failed))
                elif req.grammar is not None and req.grammar.poll(now) == "failed":
                    q.waiting.append(req)  # _end_early takes it from there
                    self._end_early(req, req.grammar.error or "grammar failed", 400)
                else:
                    q.waiting.append(req)
        req = q.chunked
        if req is not None and req.sender is not None:
            with self._guard(req, "chunked poll"):
                if req.sender.poll() is KVPoll.Failed:
                    q.chunked = None
                    self._finish(req, room_ended(req, KVPoll.Failed))

    def _poll_inflight(self) -> None:
        now = self.clock()
        q = self.queues
        pending, q.inflight = q.inflight, []
        for req in pending:
            with self._guard(req, "transfer poll"):
                assert req.sender is not None and req.inflight_since is not None
                state = req.sender.poll()
                if state.terminal:
                    self._finish(req, room_ended(req, state))
                    continue
                q.inflight.append(req)
                if now - req.inflight_since > self.cfg.transfer_timeout_s:
                    # abort is idempotent; poll reports Failed once no write for the room is in flight.
                    req.sender.abort(f"KV transfer not done within {self.cfg.transfer_timeout_s:g} s")

    def _schedule(self) -> list[tuple[PrefillReq, int]]:
        """This step's batch: (request, tokens to compute) — the chunked request first."""
        mem, q = self.memory, self.queues
        adder = PrefillAdder(self.cfg.budget, mem.available_pages(), mem.page_size)
        batch: list[tuple[PrefillReq, int]] = []
        if q.chunked is not None:
            batch.append((q.chunked, adder.add_chunked(q.chunked.prompt_len - q.chunked.computed)))
        if adder.closed or not (q.waiting or self._may_compute_ahead()):
            return batch

        prefix_len = peek_prefix_len(mem.cache)  # read-only: most waiting requests are not admitted
        now = self.clock()
        for req in order_waiting(q.waiting, self.cfg.policy, prefix_len):
            if not self._add(req, adder, prefix_len, now, batch):
                return batch
        if self._may_compute_ahead():
            ahead = sum(len(r.kv.pages) for r in q.reqs.values() if r.ahead and r.kv is not None)
            for req in list(q.bootstrap):  # arrival order
                need = mem.pages_for(req.prompt_len)
                if ahead + need > self.cfg.ahead_pages:
                    break
                admitted = len(batch)
                go_on = self._add(req, adder, prefix_len, now, batch)
                if len(batch) > admitted:
                    req.ahead, ahead = True, ahead + need
                if not go_on:
                    break
        return batch

    def _add(self, req: PrefillReq, adder: PrefillAdder, prefix_len: Callable[[PrefillReq], int], now: float,
             batch: list[tuple[PrefillReq, int]]) -> bool:
        """Admit ``req`` into ``batch`` if it fits; False: stop adding this step."""
        if req.grammar is not None and req.grammar.poll(now) != "ready":
            return True  # its grammar is compiling (or failed: dropped next step); the batch goes on
        try:
            cached_guess = prefix_len(req)
            if adder.waits_for_chunk(req.prompt_len, cached_guess):
                return True  # cannot start while another prompt is chunked; shorter ones behind it may
            n = self._admit(req, adder, cached_guess)
        except Exception as exc:  # the adder may be half-updated: stop adding this step
            self._request_error(req, "admission", exc)
            return False
        if n is None:
            return False
        batch.append((req, n))
        return not adder.closed

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
        self.queues.remove(req)  # from waiting, or from bootstrap when computed ahead
        req.kv = kv
        return n

    # ---- forward and send ----------------------------------------------------------------------

    def _forward(self, batch: list[tuple[PrefillReq, int]]) -> None:
        chunks: list[ExtendChunk] = []
        specs: list[SampleSpec | None] = []
        for req, n in batch:
            assert req.kv is not None
            start = req.kv.kv_len
            chunks.append(ExtendChunk(req.kv.row, req.input_ids[start : start + n], start))
            last = start + n == req.prompt_len
            grammar = req.grammar.matcher if req.grammar is not None else None
            specs.append(SampleSpec(req.params, (), req.input_ids, grammar) if last else None)
        t0 = self.clock()
        wall = time.time()
        for req, _ in batch:
            req.clock.lap("queue", wall)  # waiting (and, between chunks, waiting for the next turn)
        self.queues.chunked = None
        try:
            results = self.engine.run_extend(chunks, specs)
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except Exception as exc:  # a bad batch fails its requests; the node keeps serving
            log.exception("prefill forward of %d requests failed", len(batch))
            for req, _ in batch:
                self._request_error(req, None, f"prefill forward failed: {type(exc).__name__}: {exc}")
            return
        now = self.clock()
        self.counters.forwards += 1
        self.counters.forward_s += now - t0
        wall = time.time()
        for req, _ in batch:
            req.clock.lap("forward", wall)
            req.clock.forwards += 1
        for (req, n), tok in zip(batch, results):  # each request is in no queue until placed here
            with self._guard(req, "after the forward"):
                assert req.kv is not None
                if req.kv.kv_len == req.kv.num_cached:
                    self.counters.cached_tokens += req.kv.num_cached
                self.memory.written(req.kv, req.kv.kv_len, req.kv.kv_len + n, req.kv.kv_len + n == req.prompt_len)
                req.kv.kv_len += n
                self.counters.prompt_tokens += n
                last = req.kv.kv_len == req.prompt_len
                req.first = tok if last else None
                if req.ahead and req.sender is not None and req.sender.poll() is not KVPoll.Bootstrapping:
                    req.ahead = False  # the decode answered meanwhile: send as usual from here on
                if req.ahead:  # nowhere to write yet: the chunk waits in its pages
                    if not last:
                        self.queues.chunked = req
                    else:
                        self.queues.parked.append(req)
                    continue
                if req.sender is not None and not self._send(req, last):
                    continue  # ended early by a send error
                if not last:
                    self.queues.chunked = req
                elif req.sender is None:
                    self._finish(req, local_answer(req, local_finish(req, self.stop)))
                else:
                    req.inflight_since = now
                    self.queues.inflight.append(req)

    def _send(self, req: PrefillReq, last: bool) -> bool:
        """Hand the chunk's finished pages (``pages_to_send``) to the sender, and with the last
        chunk the aux record and the recurrent state. False: the send failed and ended the request."""
        kv = req.kv
        assert kv is not None and req.sender is not None
        # The decode's own cache holds the prompt's first pages: they are not sent, and the KV
        # digest covers only what is (the decode checks what arrived; docs/TRANSFER.md).
        prefix = req.sender.decode_prefix_len
        if prefix >= req.prompt_len:  # the decode must leave at least one token to send
            self._end_early(req, f"the decode claims {prefix} of the prompt's {req.prompt_len} tokens", 500)
            return False
        ps = self.memory.page_size
        pages, upto = pages_to_send(req, last, ps, prefix // ps)
        if not pages and not last:
            req.sent_pages = max(req.sent_pages, upto)
            return True
        aux = None
        if last and req.first is not None:
            aux = aux_record(req, req.first, self.cfg.aux_top_k, self.memory.room_digest(kv, req.prompt_len, prefix))
        try:
            # A hybrid model's recurrent state is final only after the last chunk; it goes with it.
            state = [kv.state_slot] if last and kv.state_slot is not None else []
            req.sender.send(pages, last, aux, state)
        except Exception as exc:  # TransferError, or a bug: either way only this request fails
            if not isinstance(exc, TransferError):
                log.exception("%s: KV send raised", req.name())
            self._end_early(req, f"KV send failed: {exc}", 500)
            return False
        req.sent_pages = upto
        return True

    # ---- ending a request ----------------------------------------------------------------------

    def _end_early(self, req: PrefillReq, reason: str, status: int | None) -> None:
        """End a request before its transfer, from any queue: abort its room, release once the
        room is terminal. ``status`` None: a client abort; else the HTTP status of the failure.

        The request reaches ``inflight`` before its room is aborted, so whatever ``abort`` does,
        the next steps still poll it to a terminal state, answer it and release it once."""
        if req.finished:
            return
        if req.abort_reason is None:
            req.abort_reason, req.abort_status = reason, status
        if req.sender is None:  # local request: nothing can read its pages
            self.queues.remove(req)
            self._finish(req, ended_early(req))
            return
        self.queues.to_inflight(req, self.clock())
        try:
            req.sender.abort(reason)
        except Exception:  # the room still ends: by the decode's answer or our transfer timeout
            log.exception("%s: aborting its room failed", req.name())

    @contextmanager
    def _guard(self, req: PrefillReq, where: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._request_error(req, where, exc)

    def _request_error(self, req: PrefillReq, where: str | None, error: Exception | str, requeue: bool = False) -> None:
        """Fail one request (500) after an error in its own handling; never raises. ``where``: what
        raised (logged with the traceback); None for a reason given as text. A request whose
        handling keeps raising for ``transfer_timeout_s`` after the first error is given up:
        answered and released without a terminal state, so it cannot stay forever."""
        now = self.clock()
        if where is not None:
            if req.error_since is None:
                log.exception("%s: %s failed; failing this request alone", req.name(), where)
                req.error_since = now
            else:
                log.debug("%s: %s failed again", req.name(), where, exc_info=True)
        reason = error if isinstance(error, str) else f"internal error ({where}): {type(error).__name__}: {error}"
        try:
            if req.finished:
                return
            if requeue and req.sender is not None:
                self.queues.park_inflight(req, req.inflight_since if req.inflight_since is not None else now)
            if req.error_since is not None and now - req.error_since > self.cfg.transfer_timeout_s:
                log.error("%s: still failing after %g s; releasing it without a terminal state",
                          req.name(), now - req.error_since)
                self.queues.remove(req)
                self._finish(req, failed(req.rid, f"{req.name()}: {reason}", 500, req.prompt_len, req.cached))
                return
            self._end_early(req, reason, 500)
        except Exception:
            log.exception("%s: could not fail the request; it ends with its transfer timeout", req.name())

    def _finish(self, req: PrefillReq, output: ReqOutput) -> None:
        """The single release of everything ``req`` holds, and its last reply. A second end of
        the same request (a bug elsewhere) is logged and dropped: raising here would fail every
        later step at the same point and wedge the node."""
        if req.finished:
            log.error("%s finished twice; the second end is dropped", req.name())
            return
        req.finished = True
        if self.queues.reqs.get(req.rid) is req:
            del self.queues.reqs[req.rid]
        self.counters.count_end(output)
        self.outbox.append(output)  # answered whatever the release below does
        if req.kv is not None:
            self.memory.release(req.kv, req.input_ids)  # computed full pages join the prefix cache

    # ---- after an internal error, and invariants ---------------------------------------------

    def fail_all(self, reason: str) -> list[ReqOutput]:
        """After an exception escaped a step: fail every live request (500); each is still
        released once, when its room is terminal, by the next steps. Never raises: a request that
        cannot be failed is logged and left to its transfer timeout. A request the error left in
        no queue goes to ``inflight``, so it is still polled, answered and released."""
        q = self.queues
        for req in list(q.reqs.values()):
            if req.abort_reason is None:
                self._request_error(req, None, reason)
        for req in q.strays():
            log.error("%s was in no queue after an internal error; ending it", req.name())
            self._request_error(req, None, reason, requeue=True)
        out, self.outbox = self.outbox, []
        return out

    def check_integrity(self) -> None:
        self.queues.check_integrity(self.memory)


# ---- arrival checks and replies ------------------------------------------------------------------


def input_error(msg: GenerateReq, memory: KVMemory, context_len: int | None) -> str | None:
    """Why the request can never run on this node (400), or None. Touches no pool."""
    n = len(msg.input_ids)
    if n == 0:
        return "empty prompt"
    if context_len is not None and n >= context_len:
        return f"prompt of {n} tokens does not fit the context length {context_len} (at least one token must follow)"
    if n > memory.req_to_token.max_context_len:
        return f"prompt of {n} tokens exceeds the context length {memory.req_to_token.max_context_len}"
    pages, total = memory.pages_for(n), memory.allocator.num_total
    if pages > total:
        return f"prompt of {n} tokens needs {pages} KV pages; this node has {total}"
    if msg.bootstrap_room is None and msg.sampling.max_new_tokens > 1:
        return ("a prefill node generates no text: send disaggregated requests (bootstrap_host/port/room) "
                "through the router, or max_new_tokens <= 1 for a local check")
    return None


def local_finish(req: PrefillReq, stop: StopChecker) -> FinishReason:
    """How a local request's one sampled token ends it (none at all for max_new_tokens 0)."""
    if req.params.max_new_tokens == 0:
        req.first = None
        return FinishReason(type="length", length=0)
    assert req.first is not None
    return stop.check(req.params, [req.first.token_id]) or FinishReason(type="length", length=1)


def peek_prefix_len(cache: RadixCache) -> Callable[[PrefillReq], int]:
    """Each waiting request's cached prefix length, read without touching the cache (memoised for
    one step): most waiting requests are not admitted this step, and stamping their prefixes every
    step would distort LRU eviction. Evictions during the step only shorten prefixes; admission
    re-checks with the real match."""
    peeked: dict[str, int] = {}

    def prefix_len(r: PrefillReq) -> int:
        if r.rid not in peeked:
            peeked[r.rid] = cache.peek_prefix_len(r.input_ids, r.prompt_len - 1)
        return peeked[r.rid]

    return prefix_len


def pages_to_send(req: PrefillReq, last: bool, page_size: int, skip_pages: int = 0) -> tuple[list[int], int]:
    """The pages a computed chunk hands to the sender, and how many are sent once they are. An
    intermediate chunk sends full pages only; a page it filled partly goes with the next chunk::

        page_size 4, chunk ends at token 10:  |0 1 2 3|4 5 6 7|8 9 . .|  -> sends pages 0, 1
        last chunk (prompt of 13 tokens):      ... |8 9 10 11|12 . . .|  -> sends pages 2, 3

    The first ``skip_pages`` pages are never sent: the decode holds their KV already
    (``decode_prefix_len``). They are still computed here, from this node's own cache or anew.
    """
    kv = req.kv
    assert kv is not None
    upto = len(kv.pages) if last else kv.kv_len // page_size
    return kv.pages[max(req.sent_pages, skip_pages) : upto], upto


def aux_record(req: PrefillReq, tok: SampledToken, top_k: int, kv_digest: bytes = b"") -> AuxRecord:
    """What the decode needs besides the KV: the first token, its logprobs, the cache hit, and
    the digest of the KV it is about to receive (common/kvcache/page_digest.py)."""
    top = tok.top_logprobs[:top_k]
    return AuxRecord(
        room=req.room or 0,
        token_id=tok.token_id,
        cached_tokens=req.cached,
        logprob=tok.logprob if tok.logprob is not None else 0.0,
        top_ids=tuple(i for i, _ in top),
        top_logprobs=tuple(lp for _, lp in top),
        kv_digest=kv_digest,
    )


def room_ended(req: PrefillReq, state: KVPoll) -> ReqOutput:
    """The reply of a request whose room reached a terminal ``state``."""
    assert req.sender is not None
    if req.abort_reason is not None:
        return ended_early(req)
    if state is KVPoll.Success:
        return transferred(req)
    reason = req.sender.failure_reason or "unknown reason"
    return failed(req.rid, f"{req.name()}: KV transfer failed: {reason}", 503, req.prompt_len, req.cached)


def ended_early(req: PrefillReq) -> ReqOutput:
    """The reply of a request ended before its transfer: a client abort, or an error (its status)."""
    reason = req.abort_reason or "aborted"
    if req.abort_status is None:
        return ReqOutput(rid=req.rid, finish=FinishReason(type="abort", message=reason),
                         prompt_tokens=req.prompt_len, cached_tokens=req.cached)
    return failed(req.rid, f"{req.name()}: {reason}", req.abort_status, req.prompt_len, req.cached)


def transferred(req: PrefillReq) -> ReqOutput:
    """A disaggregated request's answer: its KV is on the decode; the prefill generates nothing."""
    req.clock.lap("transfer")
    return ReqOutput(rid=req.rid, finish=FinishReason(type="length", length=0),
                     prompt_tokens=req.prompt_len, cached_tokens=req.cached, timeline=req.clock.times())


def local_answer(req: PrefillReq, finish: FinishReason) -> ReqOutput:
    """A local request's answer: the one token the prefill sampled (none for max_new_tokens 0)."""
    tok = req.first
    ids = [tok.token_id] if tok is not None else []
    out = ReqOutput(rid=req.rid, new_token_ids=ids, finish=finish, prompt_tokens=req.prompt_len,
                    completion_tokens=len(ids), cached_tokens=req.cached, timeline=req.clock.times())
    if tok is not None and req.params.return_logprob:
        out.new_logprobs = [tok.logprob if tok.logprob is not None else 0.0]
        out.new_top_logprobs = [list(tok.top_logprobs)]
    return out


def failed(rid: str, error: str, status: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> ReqOutput:
    return ReqOutput(rid=rid, finish=FinishReason(type="abort", message=error), prompt_tokens=prompt_tokens,
                     cached_tokens=cached_tokens, error=error, http_status=status)
