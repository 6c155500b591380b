"""What the prefill scheduler holds: its requests, the queues they wait in, its counters, and the
replies a request ends with. The logic that moves requests is ``prefill_node.scheduler``'s.

::

    queue       a request there ...                                      holds
    bootstrap   has a sender; the decode has not said where to write     sender
    waiting     may be admitted (row + cached prefix + prompt pages)     sender (none if local)
    chunked     is part-way through its prompt (at most one request)     sender, KV
    inflight    is computed or ended early; its room is not terminal     sender, KV

Every live request is in ``PrefillQueues.reqs`` and in exactly one queue or, for the moment
between being taken out of one queue and placed in the next, in a local list of the step that
moves it. ``check_integrity`` proves it between steps.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.engine.driver import SampleSpec
from common.engine.model_runner import ExtendChunk
from common.engine.sampler import SampledToken
from common.grammar.state import GrammarState
from common.ipc.protocol import GenerateReq, ReqOutput
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory, ReqKV
from common.request import FinishReason, SamplingParams
from common.sched.stop import StopChecker
from common.timeline import StageClock
from prefill_node.adder import Policy, PrefillBudget
from transfer.aux import AuxRecord
from transfer.base import KVSender
from transfer.poll import KVPoll


class ExtendEngine(Protocol):
    """``common.engine.driver.EngineDriver`` fits: one forward over prompt chunks, sampled tokens out."""

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]: ...


SenderFactory = Callable[..., KVSender]  # PrefillKVManager.create_sender(room, prompt_digest=); raises TransferError


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


@dataclass
class PrefillReq:
    rid: str
    room: int | None  # None: a local request (no decode partner; /health_generate)
    input_ids: list[int]
    params: SamplingParams
    sender: KVSender | None
    kv: ReqKV | None = None  # row + pages, from admission until the single release
    sent_pages: int = 0  # pages [0, sent_pages) of kv.pages were handed to the sender
    first: SampledToken | None = None
    inflight_since: float | None = None  # entered the inflight queue (transfer timeout clock)
    abort_reason: str | None = None  # set when it ended early: the reply is an abort, not a success
    abort_status: int | None = None  # http status of a scheduler-side failure (None: client abort)
    finished: bool = False
    error_since: float | None = None  # first internal error in this request's own handling
    grammar: GrammarState | None = None  # constrained decoding: admitted only once it is compiled
    clock: StageClock = field(default_factory=lambda: StageClock("prefill"))  # bootstrap, queue, forward, transfer

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def computed(self) -> int:
        return self.kv.kv_len if self.kv is not None else 0

    @property
    def cached(self) -> int:
        return self.kv.num_cached if self.kv is not None else 0

    def name(self) -> str:
        return f"rid {self.rid}" if self.room is None else f"room {self.room} (rid {self.rid})"


@dataclass
class PrefillCounters:
    """Running totals since start (``/metrics``; read by ``PrefillStats``)."""

    finished: int = 0
    failed: int = 0
    aborted: int = 0
    rejected: int = 0  # bad input: 400
    forwards: int = 0
    forward_s: float = 0.0
    prompt_tokens: int = 0  # computed by forwards
    cached_tokens: int = 0  # served from the prefix cache

    def count_end(self, output: ReqOutput) -> None:
        """Count a request's last reply."""
        if output.http_status == 400:  # bad input, answered once its room was aborted
            self.rejected += 1
        elif output.http_status is not None:
            self.failed += 1
        elif output.finish is not None and output.finish.type == "abort":
            self.aborted += 1
        else:
            self.finished += 1


class PrefillQueues:
    """The queues of the module docstring, the live requests by rid, and their invariants."""

    def __init__(self) -> None:
        self.bootstrap: list[PrefillReq] = []
        self.waiting: list[PrefillReq] = []
        self.chunked: PrefillReq | None = None
        self.inflight: list[PrefillReq] = []
        self.reqs: dict[str, PrefillReq] = {}  # every live request, by rid

    def queued(self) -> list[PrefillReq]:
        return [*self.bootstrap, *self.waiting, *self.inflight, *([self.chunked] if self.chunked else [])]

    def strays(self) -> list[PrefillReq]:
        """Live requests in no queue (only an exception that escaped a step leaves one so)."""
        queued = {id(r) for r in self.queued()}
        return [r for r in self.reqs.values() if id(r) not in queued]

    def remove(self, req: PrefillReq) -> None:
        """Take ``req`` out of whichever queue holds it (it stays live, in ``reqs``)."""
        if self.chunked is req:
            self.chunked = None
        for q in (self.bootstrap, self.waiting, self.inflight):
            if req in q:
                q.remove(req)

    def to_inflight(self, req: PrefillReq, since: float) -> None:
        """Out of ``bootstrap``/``waiting``/``chunked`` into ``inflight`` (kept in place if there)."""
        for q in (self.bootstrap, self.waiting):
            if req in q:
                q.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.park_inflight(req, since)

    def park_inflight(self, req: PrefillReq, since: float) -> None:
        """Into ``inflight`` (once; ``since`` starts its transfer timeout): there it is polled
        until its room is terminal, then answered and released."""
        if req not in self.inflight:
            req.inflight_since = since
            self.inflight.append(req)

    def check_integrity(self, memory: KVMemory) -> None:
        """Pools consistent, each live request in exactly one queue, each row owned by one request."""
        memory.check_integrity()
        queues = self.queued()
        rids = [r.rid for r in queues]
        assert len(rids) == len(set(rids)), f"a request is in two queues: {sorted(rids)}"
        assert set(rids) == set(self.reqs), f"queues {sorted(rids)} != live requests {sorted(self.reqs)}"
        rows = [r.kv.row for r in queues if r.kv is not None]
        assert len(rows) == len(set(rows)), "two requests share a request row"
        assert memory.req_to_token.num_used == len(rows), "request rows leaked"
        assert all(r.kv is None for r in [*self.bootstrap, *self.waiting]), "a queued request holds KV"
        if not queues:
            alloc, cache = memory.allocator, memory.cache
            assert alloc.num_used == cache.total_pages(), (
                f"idle node: {alloc.num_used} pages allocated but {cache.total_pages()} cached")
            assert cache.protected_pages() == 0, "idle node: cache pages still locked"


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
