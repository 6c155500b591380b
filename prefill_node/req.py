"""What the prefill scheduler holds: its requests, the queues they wait in, and its counters. The
logic that moves requests, and the replies they end with, are ``prefill_node.scheduler``'s.

::

    queue       a request there ...                                      holds
    bootstrap   has a sender; the decode has not said where to write     sender
                (may still be admitted ahead, see below)
    waiting     may be admitted (row + cached prefix + prompt pages)     sender (none if local)
    chunked     is part-way through its prompt (at most one request)     sender, KV
    parked      is computed, but the decode has not said where to write  sender, KV
    inflight    is computed or ended early; its room is not terminal     sender, KV

A request admitted from ``bootstrap`` (computed ahead of the decode's answer) sends nothing until
the decode has said where to write: its chunks wait in its pages, and a whole prompt waits in
``parked``; both send everything computed so far once the room leaves Bootstrapping.

Every live request is in ``PrefillQueues.reqs`` and in exactly one queue or, for the moment
between being taken out of one queue and placed in the next, in a local list of the step that
moves it. ``check_integrity`` proves it between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.sampler import SampledToken
from common.grammar.state import GrammarState
from common.ipc.protocol import ReqOutput
from common.kvcache.req_kv import KVMemory, ReqKV
from common.request import SamplingParams
from common.timeline import StageClock
from transfer.base import KVSender


@dataclass
class PrefillReq:
    rid: str
    room: int | None  # None: a local request (no decode partner; /health_generate)
    input_ids: list[int]
    params: SamplingParams
    sender: KVSender | None
    kv: ReqKV | None = None  # row + pages, from admission until the single release
    sent_pages: int = 0  # pages [0, sent_pages) of kv.pages were handed to the sender
    ahead: bool = False  # admitted before the decode said where to write (until it has)
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
        self.parked: list[PrefillReq] = []
        self.inflight: list[PrefillReq] = []
        self.reqs: dict[str, PrefillReq] = {}  # every live request, by rid

    def queued(self) -> list[PrefillReq]:
        return [*self.bootstrap, *self.waiting, *self.parked, *self.inflight, *([self.chunked] if self.chunked else [])]

    def strays(self) -> list[PrefillReq]:
        """Live requests in no queue (only an exception that escaped a step leaves one so)."""
        queued = {id(r) for r in self.queued()}
        return [r for r in self.reqs.values() if id(r) not in queued]

    def remove(self, req: PrefillReq) -> None:
        """Take ``req`` out of whichever queue holds it (it stays live, in ``reqs``)."""
        if self.chunked is req:
            self.chunked = None
        for q in (self.bootstrap, self.waiting, self.parked, self.inflight):
            if req in q:
                q.remove(req)

    def to_inflight(self, req: PrefillReq, since: float) -> None:
        """Out of ``bootstrap``/``waiting``/``chunked``/``parked`` into ``inflight`` (kept in place if there)."""
        for q in (self.bootstrap, self.waiting, self.parked):
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
        assert all(r.kv is not None and r.computed == r.prompt_len for r in self.parked), "a parked request is not computed"
        if not queues:
            alloc, cache = memory.allocator, memory.cache
            assert alloc.num_used == cache.total_pages(), (
                f"idle node: {alloc.num_used} pages allocated but {cache.total_pages()} cached")
            assert cache.protected_pages() == 0, "idle node: cache pages still locked"
