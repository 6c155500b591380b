"""Per-sequence output state in the API process: token ids, logprobs, detokenized text, finish.

``SubState.apply(ReqOutput)`` folds one scheduler message in and returns the text that became
visible with it (the incremental detokenizer holds back bytes of an unfinished character and
any tail that may still grow into a stop string). The response shapers in ``responses.py`` read
these states; nothing here knows about HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.ipc.protocol import ReqOutput
from common.request import FinishReason
from common.server.parse_common import SubRequest
from common.server.textio import TokenizerLike, new_detokenizer, token_piece
from common.timeline import StageTimes, node_timeline
from common.tokenizer import IncrementalDetokenizer


@dataclass
class SubState:
    sub: SubRequest
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # everything made visible so far
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # the prefill's prefix-cache hit
    decode_reused_tokens: int | None = None  # a decode's own prefix-cache hit; None: not a decode's answer
    decode_computed_tokens: int | None = None  # prompt tokens a decode computed itself (a local request)
    error: str | None = None
    http_status: int | None = None
    # how many of output_ids / logprobs a stream has already sent (OpenAI streams send deltas)
    sent_tokens: int = 0
    times: StageTimes | None = None  # the scheduler's stages, with the final output

    @classmethod
    def new(cls, sub: SubRequest, tok: TokenizerLike) -> SubState:
        detok = new_detokenizer(tok, sub.input_ids, sub.sampling.stop, sub.sampling.skip_special_tokens)
        return cls(sub=sub, detok=detok, prompt_tokens=len(sub.input_ids))

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def apply(self, out: ReqOutput) -> str:
        """Fold one output in; return the newly visible text."""
        self.output_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs is not None:
            self.top_logprobs.extend([list(x) for x in out.new_top_logprobs])
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(out.completion_tokens, len(self.output_ids))
        self.cached_tokens = out.cached_tokens
        if out.decode_reused_tokens is not None:
            self.decode_reused_tokens = out.decode_reused_tokens
        if out.decode_computed_tokens is not None:
            self.decode_computed_tokens = out.decode_computed_tokens
        delta = self.detok.add(out.new_token_ids, out.finish)
        if out.timeline is not None:
            self.times = out.timeline
        if out.finish is not None:
            self.finish = out.finish
            self.error = out.error
            self.http_status = out.http_status
        self.text += delta
        return delta

    def fail(self, status: int, message: str) -> None:
        """Finish locally (scheduler gone, client-visible timeout)."""
        self.finish = FinishReason(type="abort", message=message)
        self.error = message
        self.http_status = status

    @property
    def failed(self) -> bool:
        return self.error is not None and (self.http_status or 500) >= 400

    def meta_info(self, return_text_in_logprobs: bool = False, tok: TokenizerLike | None = None) -> dict:
        """SGLang's native meta_info for this sequence."""
        meta: dict = {
            "id": self.sub.rid,
            "finish_reason": self.finish.to_json() if self.finish is not None else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.decode_reused_tokens is not None:  # only on a decode node's answer
            meta["decode_reused_tokens"] = self.decode_reused_tokens
        if self.decode_computed_tokens is not None:  # a local request: no KV was transferred
            meta["decode_computed_tokens"] = self.decode_computed_tokens
        if self.sub.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, _piece(tok, tid) if return_text_in_logprobs else None]
                for lp, tid in zip(self.logprobs, self.output_ids)
            ]
            if self.sub.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [[lp, tid, _piece(tok, tid) if return_text_in_logprobs else None] for tid, lp in step]
                    for step in self.top_logprobs
                ]
        if self.error is not None:
            meta["error"] = self.error
        return meta

    def timeline(self, arrival: float) -> dict | None:
        """``meta_info["timeline"]`` (common.timeline), once the scheduler reported its stages."""
        return None if self.times is None else node_timeline(self.times, arrival)


def _piece(tok: TokenizerLike | None, tid: int) -> str | None:
    return token_piece(tok, tid) if tok is not None else None
