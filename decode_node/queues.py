"""The decode scheduler's queues and the ways out of them (``DecodeScheduler`` builds on this).

Every live request is in ``reqs`` and one queue (``prealloc``, ``transfer``, ``waiting``,
``running``, ``retracted``; see ``decode_node.req.Stage`` for what each stage owns). Answers are
collected in an outbox the step returns. A request leaves by ``_finish`` (done), ``_fail``
(error; only once its receiver is terminal or was never created), ``_refuse`` (a 400 on arrival,
also told to its prefill) or ``abort``: a room whose TransferInfo may be out is answered at once
but keeps its pages in ``draining`` until its receiver reports a terminal state (the transfer
layer's fence), then they are freed once. A room that failed while its prefill may still write
(``receiver.fenced()``: the peer stopped answering past its bound) is answered the same way and
stays in ``draining`` until the fence is lifted, however long that takes: its pages are neither
free nor leaked (``fenced_reqs`` in /debug/memory).
"""
from __future__ import annotations

import logging
import time
from collections import deque

from common.kvcache.req_kv import KVMemory
from common.ipc.protocol import ReqOutput
from common.request import FinishReason
from decode_node.req import AuxSlots, DecodeReq, ReceiverFactory, Stage

log = logging.getLogger(__name__)


class DecodeQueues:
    def __init__(self, memory: KVMemory, receivers: ReceiverFactory, aux: AuxSlots, drain_warn_s: float) -> None:
        self.memory, self.receivers, self.aux, self.drain_warn_s = memory, receivers, aux, drain_warn_s
        self.reqs: dict[str, DecodeReq] = {}  # every live request by rid (not draining ones)
        self.prealloc: deque[DecodeReq] = deque()
        self.transfer: list[DecodeReq] = []
        self.waiting: deque[DecodeReq] = deque()
        self.running: list[DecodeReq] = []
        self.retracted: deque[DecodeReq] = deque()
        self.draining: list[DecodeReq] = []
        self._outbox: list[ReqOutput] = []
        self.counters: dict[str, float] = {"generated_tokens": 0, "retractions": 0, "finished": 0, "failed": 0,
                                           "aborted": 0, "decode_steps": 0, "decode_batch_reqs": 0,
                                           "decode_forward_seconds": 0.0, "decode_step_seconds": 0.0}

    def abort(self, rid: str, reason: str = "aborted", http_status: int | None = None) -> None:
        """Answer at once; free what is ours now, fence what the prefill may still write.
        With ``http_status`` the answer is an error (e.g. 500 when the step itself failed)."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return  # finished already, or never here
        self.counters["aborted"] += 1
        r.finish = FinishReason(type="abort", message=reason)
        if http_status is not None:
            r.error, r.http_status = reason, http_status
        self._emit(r)
        if r.stage in (Stage.PREALLOC, Stage.TRANSFER):
            self._remove(r)
            assert r.receiver is not None
            # Draining first: whatever abort() does, the room is still polled to its end and
            # its pages freed once (the transfer layer's own timeouts end it in any case).
            r.stage, r.drain_since = Stage.DRAINING, time.monotonic()
            self.draining.append(r)
            try:
                r.receiver.abort(f"{r.label()}: {reason}")
            except Exception:
                log.exception("%s: aborting its transfer failed", r.label())
        else:
            self._remove(r)
            self._free(r)

    def fail_all(self, reason: str) -> list[ReqOutput]:
        """After an internal error: answer every live request with a 500 and release what it holds."""
        for rid in list(self.reqs):
            self.abort(rid, reason, http_status=500)
        out, self._outbox = self._outbox, []
        return out

    @property
    def busy(self) -> bool:
        """A forward to run: the loop should turn without waiting for input."""
        return bool(self.running or self.waiting)

    @property
    def idle(self) -> bool:
        return not (self.reqs or self.draining)

    # ---- endings --------------------------------------------------------------------------------

    def _finish(self, r: DecodeReq) -> None:
        self._free(r)
        self.reqs.pop(r.rid, None)
        r.stage = Stage.DONE
        self.counters["finished"] += 1
        self._emit(r)

    def _fail(self, r: DecodeReq, status: int, message: str) -> None:
        """Finish with an error; only for rooms whose receiver is terminal (or never created).
        A fenced receiver's memory goes to ``draining`` instead of back to the pools."""
        log.warning("%s", message)
        self._remove(r)
        if r.receiver is not None and r.receiver.fenced():
            r.stage, r.drain_since = Stage.DRAINING, time.monotonic()
            self.draining.append(r)
        else:
            self._free(r)
        if self.reqs.get(r.rid) is r:  # a rejected duplicate must not drop the live request
            del self.reqs[r.rid]
        if r.stage is not Stage.DRAINING:
            r.stage = Stage.DONE
        self.counters["failed"] += 1
        r.finish, r.error, r.http_status = FinishReason(type="abort", message=message), message, status
        self._emit(r)

    def _refuse(self, r: DecodeReq, message: str) -> None:
        """Reject a request that got no receiver (400) and tell its prefill, whose sender would
        otherwise wait for our TransferInfo until its bootstrap timeout (and a router waiting
        for both answers would hold the client's 400 that long). A room that is live here
        belongs to another request: the transfer layer leaves it alone."""
        self._fail(r, 400, message)
        if r.room is not None and r.bootstrap_addr is not None:
            try:
                self.receivers.reject_room(r.room, r.bootstrap_addr, message)
            except Exception:  # telling the prefill is best effort; its timeout still ends the room
                log.exception("%s: could not tell the prefill it was refused", r.label())

    def _drain(self) -> None:
        now = time.monotonic()
        for r in list(self.draining):
            assert r.receiver is not None
            if r.receiver.poll().terminal and not r.receiver.fenced():
                self.draining.remove(r)
                self._free(r)
                r.stage = Stage.DONE
            elif now - r.drain_since > self.drain_warn_s:
                what = "its prefill may still write (pages fenced)" if r.receiver.fenced() else "its transfer has not ended yet"
                log.warning("%s: answered %.0f s ago, %s", r.label(), now - r.drain_since, what)
                r.drain_since = now

    def _free(self, r: DecodeReq) -> None:
        """Give back everything ``r`` holds (each resource once; safe to call again)."""
        if r.kv is not None:
            self.memory.release(r.kv, None)  # decode keeps no prefix cache: received KV is freed
            r.kv = None
        if r.aux_slot is not None:
            self.aux.free(r.aux_slot)
            r.aux_slot = None

    def _remove(self, r: DecodeReq) -> None:
        """Take ``r`` out of whichever queue holds it."""
        for q in (self.prealloc, self.transfer, self.waiting, self.running, self.retracted):
            if r in q:
                q.remove(r)
                return

    def _emit(self, r: DecodeReq) -> None:
        if r.finish is not None or r.stream:  # non-streaming requests: only the final output
            self._outbox.append(r.take_output())
