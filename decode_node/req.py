"""What the decode scheduler holds: its requests, the queues they wait in, and its counters. The
logic that moves requests is ``decode_node.scheduler``'s; what it is built on, ``decode_node.ports``.

The stage says which queue holds the request and what it owns::

    stage        queue        owns
    PREALLOC     prealloc     receiver
    TRANSFER     transfer     receiver, row + prompt pages, aux slot
    WAITING      waiting      row + prompt pages (KV landed; first token read from aux)
    RUNNING      running      row + pages
    RETRACTED    retracted    nothing (tokens only; resumes by recompute)
    DRAINING     draining     receiver (+ pages, aux slot): answered, waits until no write can land
    DONE         -            nothing

Every live request is in ``DecodeQueues.reqs`` and in exactly one of the first five queues; a
draining request was answered already, so it is no longer in ``reqs``. ``check_integrity``
proves it between steps.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.driver import SampleSpec
from common.grammar.state import GrammarState
from common.ipc.protocol import ReqOutput
from common.kvcache.req_kv import KVMemory, ReqKV
from common.request import FinishReason, SamplingParams
from common.sched.stop import StopChecker
from common.timeline import StageClock
from decode_node.admission import Holder
from decode_node.ports import AuxSlots
from transfer.base import KVReceiver


class Stage(enum.Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    DRAINING = "draining"
    DONE = "done"


@dataclass
class DecodeReq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    room: int | None  # None: a local request (no prefill), computed here from the prompt
    bootstrap_addr: str | None
    arrival: float
    stage: Stage = Stage.PREALLOC
    receiver: KVReceiver | None = None
    kv: ReqKV | None = None
    aux_slot: int | None = None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: int = 0  # output tokens already sent to the API process
    cached_tokens: int = 0  # prompt tokens the prefill served from its prefix cache
    # Prompt tokens this node's own prefix cache served: set when a room's KV arrived, or when a
    # local request's prompt was computed here (then ``cached_tokens`` is the same hit).
    reused_tokens: int = 0
    computed_tokens: int = 0  # a local request: prompt tokens computed here, past the cached prefix
    finish: FinishReason | None = None
    error: str | None = None
    http_status: int | None = None
    retractions: int = 0
    drain_since: float = 0.0
    # prealloc, kv_transfer, first_token, decode (a local request: local_prefill, first_token, decode)
    clock: StageClock = field(default_factory=lambda: StageClock("decode"))
    # Constrained decoding: the matcher, advanced by every output token (the prefill's first one
    # included) before the next is sampled. Kept across retraction: recompute rebuilds KV only.
    grammar: GrammarState | None = None
    _spec: SampleSpec | None = field(default=None, repr=False)

    def sample_spec(self) -> SampleSpec:
        """One spec for the request's life: it reads the live output list when sampling (and the
        live matcher: a request samples only once its grammar is ready)."""
        if self._spec is None:
            matcher = self.grammar.matcher if self.grammar is not None else None
            assert self.grammar is None or matcher is not None, "sampling before the grammar is ready"
            self._spec = SampleSpec(self.params, self.out, self.prompt, matcher)
        return self._spec

    def grammar_ready(self, now: float) -> bool:
        """False while the grammar compiles. Once ready, the matcher is caught up with ``out``,
        and the request is finished if the grammar completed (stop) or failed (an error: a
        compile error or timeout is a 400; a token it refuses is a dead end, dropped from ``out``)."""
        g = self.grammar
        if g is None or self.finish is not None and self.error is not None:
            return True
        status = g.poll(now)
        if status == "pending":
            return False
        if status == "ready" and g.sync(self.out):
            if g.done() and (self.finish is None or self.finish.type == "length"):
                self.finish = FinishReason(type="stop", matched=None)  # the schema is complete
            return True
        del self.out[g.consumed :]  # the refused token (if any) never reaches the client
        if self.params.return_logprob:
            del self.logprobs[g.consumed :], self.top_logprobs[g.consumed :]
        self.error, self.http_status = g.error, 400
        self.finish = FinishReason(type="abort", message=g.error)
        return True

    @property
    def max_new(self) -> int:
        return self.params.max_new_tokens

    @property
    def steps_left(self) -> int:
        """Decode steps this request may still run (each writes one token's KV)."""
        return max(self.max_new - max(len(self.out), 1), 0)

    def recompute_ids(self) -> Sequence[int]:
        """Tokens whose KV a resumed request needs: prompt + every output token but the newest
        (the newest is the next decode step's input). A local request with no output yet
        computes its whole prompt and samples its first token from the last chunk."""
        return self.prompt + self.out[:-1]

    def reserve_room(self, memory: KVMemory, aux: AuxSlots) -> bool:
        """Row (with a state slot, for hybrid models) + prompt pages + aux slot, all or nothing.
        With the decode's prefix cache on, the row starts with the longest cached prefix of the
        prompt (whole pages, at least one token left to receive), locked until ``release``."""
        kv = memory.admit(self.prompt, use_cache=memory.cache.enabled)
        if kv is None:
            return False
        slot = aux.alloc() if memory.reserve(kv, len(self.prompt)) else None
        if slot is None:
            memory.release(kv, None)
            return False
        self.kv, self.aux_slot = kv, slot
        return True

    def release(self, memory: KVMemory, aux: AuxSlots, cache: bool = False) -> None:
        """Give back everything this request holds (each resource once; safe to call again).
        ``cache``: its KV is whole (a finished request), so its full pages (prompt + output) go to
        the prefix cache, a no-op when that is off; otherwise (failed, aborted, retracted) its own
        pages are freed and its cached prefix only unlocked."""
        if self.kv is not None:
            kv, self.kv = self.kv, None
            # Position i holds the KV of (prompt + out)[i]; the newest token's is never written.
            ids = self.prompt + self.out
            memory.release(kv, ids[: kv.kv_len] if cache and len(ids) >= kv.kv_len else None)
        if self.aux_slot is not None:
            aux.free(self.aux_slot)
            self.aux_slot = None

    def append(self, token: int, logprob: float | None, top: Sequence[tuple[int, float]], stop: StopChecker) -> None:
        """One more output token (with its logprobs when asked for); sets ``finish`` if a stop rule matched."""
        self.out.append(token)
        if self.params.return_logprob:
            self.logprobs.append(0.0 if logprob is None else logprob)
            self.top_logprobs.append(list(top)[: self.params.top_logprobs_num])
        self.finish = stop.check(self.params, self.out)

    def label(self) -> str:
        return f"rid {self.rid}" + (f" (room {self.room})" if self.room is not None else "")

    def holder(self) -> Holder:
        """This request as the memory budget sees it."""
        if self.kv is None:  # retracted: what it must recompute
            kv_len, held = len(self.recompute_ids()), 0
        else:  # a room in transfer is promised its whole prompt
            kv_len, held = max(self.kv.kv_len, len(self.prompt)), len(self.kv.pages)
        return Holder(kv_len=kv_len, steps_left=self.steps_left, held_pages=held, output_len=len(self.out),
                      prompt_len=len(self.prompt))

    def take_output(self) -> ReqOutput:
        """Everything new since the last output; counters are running totals."""
        new = slice(self.sent, len(self.out))
        lp = self.params.return_logprob
        self.sent = len(self.out)
        timeline = None
        if self.finish is not None and self.error is None:
            self.clock.lap("decode")
            # decode steps (the first token came from the prefill, or a local request's compute)
            self.clock.forwards = max(len(self.out) - 1, 0)
            timeline = self.clock.times()
        return ReqOutput(
            rid=self.rid, new_token_ids=self.out[new], new_logprobs=self.logprobs[new] if lp else None,
            new_top_logprobs=self.top_logprobs[new] if lp and self.params.top_logprobs_num else None,
            finish=self.finish, prompt_tokens=len(self.prompt), completion_tokens=len(self.out),
            cached_tokens=self.cached_tokens, decode_reused_tokens=self.reused_tokens,
            decode_computed_tokens=self.computed_tokens if self.room is None else None,
            error=self.error, http_status=self.http_status, timeline=timeline)


@dataclass
class DecodeCounters:
    """Running totals since start; ``/metrics`` exports each as ``pdc_scheduler_<name>_total``."""

    generated_tokens: int = 0
    # Prompt tokens of rooms that arrived: those whose KV came over the wire, and those this
    # node's own prefix cache served (``decode_prefix_len``); /metrics names them
    # pdc_decode_transferred_tokens_total and pdc_decode_reused_tokens_total.
    transferred_tokens: int = 0
    reused_tokens: int = 0
    transferred_pages: int = 0  # pages the prefill wrote (a partly filled last one counts whole)
    # Prompt tokens of local requests (no room) computed on this node, past their cached prefix
    # (their cached prefix counts in reused_tokens): pdc_decode_local_prefill_tokens_total.
    local_prefill_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    decode_steps: int = 0
    decode_batch_reqs: int = 0
    decode_forward_seconds: float = 0.0  # in the engine's decode forward
    # The whole loop turn of each step that ran a decode (input, queues, forward, stop checks,
    # output IPC), added by DecodeStats.observe_step after the turn: minus
    # decode_forward_seconds it is the per-step overhead `pdcluster bench` reports.
    decode_step_seconds: float = 0.0


class DecodeQueues:
    """The queues of the module docstring, the live requests by rid, and their invariants."""

    def __init__(self) -> None:
        self.reqs: dict[str, DecodeReq] = {}  # every live request by rid (not draining ones)
        self.prealloc: deque[DecodeReq] = deque()
        self.transfer: list[DecodeReq] = []
        self.waiting: deque[DecodeReq] = deque()
        self.running: list[DecodeReq] = []
        self.retracted: deque[DecodeReq] = deque()
        self.draining: list[DecodeReq] = []

    def remove(self, r: DecodeReq) -> None:
        """Take ``r`` out of whichever live queue holds it."""
        for q in (self.prealloc, self.transfer, self.waiting, self.running, self.retracted):
            if r in q:
                q.remove(r)
                return

    def num_queued(self) -> int:
        """Live requests not in the running batch."""
        return len(self.prealloc) + len(self.transfer) + len(self.waiting) + len(self.retracted)

    def check_integrity(self, memory: KVMemory, aux: AuxSlots) -> None:
        """Pools consistent; each live request in exactly one queue, in the stage that queue
        means; each row and aux slot owned by one request (live or draining)."""
        memory.check_integrity()
        aux.check_integrity()
        stages = ((self.prealloc, Stage.PREALLOC), (self.transfer, Stage.TRANSFER), (self.waiting, Stage.WAITING),
                  (self.running, Stage.RUNNING), (self.retracted, Stage.RETRACTED), (self.draining, Stage.DRAINING))
        for q, stage in stages:
            assert all(r.stage is stage for r in q), f"a request in the {stage.value} queue is not in that stage"
        live = [r for q, _ in stages[:5] for r in q]
        assert len({id(r) for r in live}) == len(live), "a request is in two queues"
        assert sorted(r.rid for r in live) == sorted(self.reqs), "queues != live requests"
        assert all(self.reqs[r.rid] is r for r in live), "a queued request is not the live one of its rid"
        holders = [*live, *self.draining]
        rows = [r.kv.row for r in holders if r.kv is not None]
        assert len(rows) == len(set(rows)) == memory.req_to_token.num_used, "request rows leaked or shared"
        slots = [r.aux_slot for r in holders if r.aux_slot is not None]
        assert len(slots) == len(set(slots)), "two requests share an aux slot"
        assert all(r.kv is None and r.aux_slot is None for r in [*self.prealloc, *self.retracted]), \
            "a request holds memory in a stage that owns none"
