"""One request as the prefill scheduler tracks it, and the replies it ends with."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.sampler import SampledToken
from common.kvcache.req_kv import ReqKV
from common.ipc.protocol import ReqOutput
from common.request import FinishReason, SamplingParams
from common.timeline import StageClock
from transfer.aux import AuxRecord
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
    first: SampledToken | None = None
    drain_since: float | None = None  # entered the inflight queue (transfer timeout clock)
    abort_reason: str | None = None  # set by an abort: the reply is an abort, not a success
    abort_status: int | None = None  # http status of a scheduler-side failure (None: client abort)
    finished: bool = False
    error_since: float | None = None  # first internal error in this request's own handling
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


def aux_record(req: PrefillReq, tok: SampledToken, top_k: int) -> AuxRecord:
    """What the decode needs besides the KV: the first token, its logprobs, the cache hit."""
    top = tok.top_logprobs[:top_k]
    return AuxRecord(
        room=req.room or 0,
        token_id=tok.token_id,
        cached_tokens=req.cached,
        logprob=tok.logprob if tok.logprob is not None else 0.0,
        top_ids=tuple(i for i, _ in top),
        top_logprobs=tuple(lp for _, lp in top),
    )


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


def aborted(req: PrefillReq, reason: str) -> ReqOutput:
    return ReqOutput(rid=req.rid, finish=FinishReason(type="abort", message=reason),
                     prompt_tokens=req.prompt_len, cached_tokens=req.cached)


def failed(rid: str, error: str, status: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> ReqOutput:
    return ReqOutput(rid=rid, finish=FinishReason(type="abort", message=error), prompt_tokens=prompt_tokens,
                     cached_tokens=cached_tokens, error=error, http_status=status)
