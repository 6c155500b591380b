"""The prefill scheduler's queues and the one way out of them (``PrefillScheduler`` builds on this).

Every live request is in ``reqs`` and in exactly one queue (``bootstrap``, ``waiting``,
``chunked``, ``inflight``) or, for the moment between being taken out of one queue and placed in
the next, in a local list of the step that moves it. It leaves through ``_finish`` only, which
answers it and releases its KV exactly once. Ending a request early (``_drain``) aborts its room
and parks it in ``inflight`` until the room is terminal, because only then no transfer reads its
pages any more.

An exception in one request's handling fails that request alone (``_guard`` ->
``_request_error``); ``fail_all`` is the net after an exception that escaped a whole step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from common.kvcache.req_kv import KVMemory
from common.ipc.protocol import ReqOutput
from prefill_node.req import PrefillReq, aborted, failed, transferred
from transfer.poll import KVPoll

log = logging.getLogger(__name__)


@dataclass
class Counters:
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    rejected: int = 0
    forwards: int = 0
    forward_s: float = 0.0
    prompt_tokens: int = 0  # computed by forwards
    cached_tokens: int = 0  # served from the prefix cache


class PrefillQueues:
    def __init__(self, memory: KVMemory, give_up_s: float, clock: Callable[[], float]) -> None:
        self.memory, self.give_up_s, self.clock = memory, give_up_s, clock
        self.bootstrap: list[PrefillReq] = []
        self.waiting: list[PrefillReq] = []
        self.chunked: PrefillReq | None = None
        self.inflight: list[PrefillReq] = []
        self.reqs: dict[str, PrefillReq] = {}  # every live request, by rid
        self.counters = Counters()

    def fail_all(self, reason: str) -> list[ReqOutput]:
        """After an internal error: fail every live request (500); each is still released once,
        when its room is terminal, by the next steps. Never raises: a request that cannot be
        failed is logged and left to its transfer timeout. A request the error left in no queue
        goes to ``inflight``, so it is still polled, answered and released."""
        out: list[ReqOutput] = []
        for req in list(self.reqs.values()):
            if req.abort_reason is None:
                self._request_error(req, None, reason, out)
        queued = {id(r) for r in (*self.bootstrap, *self.waiting, *self.inflight, self.chunked)}
        for req in list(self.reqs.values()):
            if id(req) not in queued:
                log.error("%s was in no queue after an internal error; draining it", req.name())
                self._request_error(req, None, reason, out, requeue=True)
        return out

    # ---- ending a request --------------------------------------------------------------------

    def _drain(self, req: PrefillReq, reason: str, status: int | None, out: list[ReqOutput]) -> None:
        """End a request early from any queue: abort its room, release once the room is terminal.

        The request reaches ``inflight`` before its room is aborted, so whatever ``abort`` does,
        the next steps still poll it to a terminal state, answer it and release it once."""
        if req.finished:
            return
        if req.abort_reason is None:
            req.abort_reason, req.abort_status = reason, status
        if self.chunked is req:
            self.chunked = None
        if req in self.bootstrap:
            self.bootstrap.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.sender is None:  # local request: nothing can read its pages
            self._finish(req, self._abort_output(req, reason, status), out)
            return
        if req not in self.inflight:
            req.drain_since = self.clock()
            self.inflight.append(req)
        try:
            req.sender.abort(reason)
        except Exception:  # the room still ends: by the decode's answer or our transfer timeout
            log.exception("%s: aborting its room failed", req.name())

    @contextmanager
    def _guard(self, req: PrefillReq, where: str, out: list[ReqOutput]) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._request_error(req, where, exc, out)

    def _request_error(self, req: PrefillReq, where: str | None, error: Exception | str, out: list[ReqOutput],
                       requeue: bool = False) -> None:
        """Fail one request (500) after an error in its own handling; never raises.

        ``where``: what raised (logged with the traceback); None for a reason given as text.
        A request whose handling keeps raising for ``give_up_s`` after the first error
        is given up: answered and released without a terminal state, so it cannot stay forever.
        """
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
            if requeue and req.sender is not None and req not in self.inflight:
                req.drain_since = req.drain_since if req.drain_since is not None else now
                self.inflight.append(req)
            if req.error_since is not None and now - req.error_since > self.give_up_s:
                log.error("%s: still failing after %g s; releasing it without a terminal state",
                          req.name(), now - req.error_since)
                self._unqueue(req)
                self._finish(req, failed(req.rid, f"{req.name()}: {reason}", 500, req.prompt_len, req.cached), out)
                return
            self._drain(req, reason, 500, out)
        except Exception:
            log.exception("%s: could not fail the request; it ends with its transfer timeout", req.name())

    def _unqueue(self, req: PrefillReq) -> None:
        if self.chunked is req:
            self.chunked = None
        for q in (self.bootstrap, self.waiting, self.inflight):
            if req in q:
                q.remove(req)

    def _finish_transfer(self, req: PrefillReq, state: KVPoll, out: list[ReqOutput]) -> None:
        assert req.sender is not None
        if req.abort_reason is not None:
            output = self._abort_output(req, req.abort_reason, req.abort_status)
        elif state is KVPoll.Success:
            output = transferred(req)
        else:
            reason = req.sender.failure_reason or "unknown reason"
            output = failed(req.rid, f"{req.name()}: KV transfer failed: {reason}", 503, req.prompt_len, req.cached)
        self._finish(req, output, out)

    def _abort_output(self, req: PrefillReq, reason: str, status: int | None) -> ReqOutput:
        if status is None:
            return aborted(req, reason)
        return failed(req.rid, f"{req.name()}: {reason}", status, req.prompt_len, req.cached)

    def _finish(self, req: PrefillReq, output: ReqOutput, out: list[ReqOutput]) -> None:
        """The single release of everything ``req`` holds, and its last reply. A second end of
        the same request (a bug elsewhere) is logged and dropped: raising here would fail every
        later step at the same point and wedge the node."""
        if req.finished:
            log.error("%s finished twice; the second end is dropped", req.name())
            return
        req.finished = True
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]
        if output.http_status == 400:  # bad input, answered once its room was aborted
            self.counters.rejected += 1
        elif output.http_status is not None:
            self.counters.failed += 1
        elif output.finish is not None and output.finish.type == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        out.append(output)  # answered whatever the release below does
        if req.kv is not None:
            self.memory.release(req.kv, req.input_ids)  # computed full pages join the prefix cache

    # ---- invariants ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pools consistent, each live request in exactly one queue, each row owned by one request."""
        self.memory.check_integrity()
        queues = [*self.bootstrap, *self.waiting, *self.inflight, *([self.chunked] if self.chunked else [])]
        rids = [r.rid for r in queues]
        assert len(rids) == len(set(rids)), f"a request is in two queues: {sorted(rids)}"
        assert set(rids) == set(self.reqs), f"queues {sorted(rids)} != live requests {sorted(self.reqs)}"
        rows = [r.kv.row for r in queues if r.kv is not None]
        assert len(rows) == len(set(rows)), "two requests share a request row"
        assert self.memory.req_to_token.num_used == len(rows), "request rows leaked"
        assert all(r.kv is None for r in [*self.bootstrap, *self.waiting]), "a queued request holds KV"
        if not queues:
            alloc, cache = self.memory.allocator, self.memory.cache
            assert alloc.num_used == cache.total_pages(), (
                f"idle node: {alloc.num_used} pages allocated but {cache.total_pages()} cached")
            assert cache.protected_pages() == 0, "idle node: cache pages still locked"
