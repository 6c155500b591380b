"""Response bodies: native SGLang, OpenAI completion and chat — whole, and as SSE chunks.

Pure functions of ``ParsedRequest`` + ``SubState``s, so unit tests can check shapes without a
server. Native streams carry the *cumulative* text and ids (like SGLang); OpenAI streams carry
deltas.
"""
from __future__ import annotations

from typing import Any

import msgspec

from common.server.outputs import SubState
from common.server.parse_common import ParsedRequest
from common.server.tools import CallScanner, extract_tool_calls, new_call_id, stream_safe_len
from common.server.textio import TokenizerLike, token_piece

DONE = b"data: [DONE]\n\n"
# Compact UTF-8 JSON like json.dumps(ensure_ascii=False, separators=(",", ":")), at a tenth of its
# cost per chunk (one chunk per streamed token). Floats use the shortest round-trip form
# (1e-05 comes out as 0.00001: the same number), and NaN/inf become null, which is valid JSON.
_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


_piece = token_piece


# ---- usage -------------------------------------------------------------------------------------


def usage(req: ParsedRequest, states: list[SubState]) -> dict:
    """Prompt tokens count once per prompt, not once per sample (OpenAI's n semantics).
    ``prompt_tokens_details.cached_tokens`` is the prefill's prefix-cache hit; a decode node adds
    ``decode_reused_tokens`` beside it (its own cache's hit: KV that was not transferred), and on a
    local request ``decode_computed_tokens`` (the prompt tokens it computed itself)."""
    return _usage([s for s in states if s.sub.index % req.n == 0], states)


def _usage(prompts: list[SubState], samples: list[SubState]) -> dict:
    """Usage of ``samples``, whose prompts are counted once each through ``prompts``."""
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(s.completion_tokens for s in samples)
    details: dict[str, int] = {"cached_tokens": sum(s.cached_tokens for s in prompts)}
    reused = [s.decode_reused_tokens for s in prompts if s.decode_reused_tokens is not None]
    if reused:
        details["decode_reused_tokens"] = sum(reused)
    computed = [s.decode_computed_tokens for s in prompts if s.decode_computed_tokens is not None]
    if computed:
        details["decode_computed_tokens"] = sum(computed)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


# ---- native ------------------------------------------------------------------------------------


def native_item(req: ParsedRequest, s: SubState, tok: TokenizerLike, stream: bool = False) -> dict:
    out = {"text": s.text, "output_ids": list(s.output_ids),
           "meta_info": s.meta_info(req.return_text_in_logprobs, tok)}
    timeline = s.timeline(req.arrival_time)
    if timeline is not None:  # our extension: always on the native endpoint
        out["meta_info"]["timeline"] = timeline
    if stream or req.batch:
        out["index"] = s.sub.index
    return out


def native_body(req: ParsedRequest, states: list[SubState], tok: TokenizerLike) -> Any:
    items = [native_item(req, s, tok) for s in states]
    return items if req.batch else items[0]


# ---- OpenAI logprobs ---------------------------------------------------------------------------


def completion_logprobs(s: SubState, tok: TokenizerLike, start: int, end: int, text_offset: int) -> dict:
    tokens = [_piece(tok, t) for t in s.output_ids[start:end]]
    offsets = []
    for p in tokens:
        offsets.append(text_offset)
        text_offset += len(p)
    top = None
    if s.sub.top_logprobs_num:
        top = [{_piece(tok, tid): lp for tid, lp in step} for step in s.top_logprobs[start:end]]
    return {"tokens": tokens, "token_logprobs": s.logprobs[start:end], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(s: SubState, tok: TokenizerLike, start: int, end: int) -> dict:
    content = []
    tops = s.top_logprobs[start:end] if s.sub.top_logprobs_num else [[] for _ in range(start, end)]
    for tid, lp, top in zip(s.output_ids[start:end], s.logprobs[start:end], tops):
        piece = _piece(tok, tid)
        content.append({
            "token": piece, "logprob": lp, "bytes": list(piece.encode()),
            "top_logprobs": [{"token": _piece(tok, t), "logprob": v, "bytes": list(_piece(tok, t).encode())}
                             for t, v in top],
        })
    return {"content": content}


# ---- OpenAI whole bodies -----------------------------------------------------------------------


def _finish(s: SubState) -> tuple[str | None, Any]:
    if s.finish is None:
        return None, None
    matched = s.finish.matched if s.finish.type == "stop" else None
    return s.finish.openai, matched


def _with_timeline(req: ParsedRequest, s: SubState, choice: dict) -> dict:
    """An OpenAI choice carries the stage timeline only when the request asked for it
    (``"return_timeline": true``): clients see a standard body otherwise."""
    if req.return_timeline:
        timeline = s.timeline(req.arrival_time)
        if timeline is not None:
            choice["timeline"] = timeline
    return choice


def completion_body(req: ParsedRequest, states: list[SubState], tok: TokenizerLike) -> dict:
    choices = []
    for s in states:
        reason, matched = _finish(s)
        lp = completion_logprobs(s, tok, 0, len(s.output_ids), 0) if s.sub.return_logprob else None
        choices.append(_with_timeline(req, s, {"index": s.sub.index, "text": s.text, "logprobs": lp,
                                               "finish_reason": reason, "matched_stop": matched}))
    return {"id": req.rid, "object": "text_completion", "created": int(req.arrival_time), "model": req.model,
            "choices": choices, "usage": usage(req, states)}


def _tool_answer(req: ParsedRequest, s: SubState) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished chat answer; calls only when the request had tools
    and the answer ended on its own (a call cut short by max_tokens stays text)."""
    if req.tools is None or s.finish is None or s.finish.type != "stop":
        return s.text, []
    return extract_tool_calls(s.text, req.tools)


def chat_body(req: ParsedRequest, states: list[SubState], tok: TokenizerLike) -> dict:
    choices = []
    for s in states:
        reason, matched = _finish(s)
        lp = chat_logprobs(s, tok, 0, len(s.output_ids)) if s.sub.return_logprob else None
        content, calls = _tool_answer(req, s)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"], reason = calls, "tool_calls"
        choices.append(_with_timeline(req, s, {"index": s.sub.index, "message": message,
                                               "logprobs": lp, "finish_reason": reason, "matched_stop": matched}))
    return {"id": req.rid, "object": "chat.completion", "created": int(req.arrival_time), "model": req.model,
            "choices": choices, "usage": usage(req, states)}


def whole_body(req: ParsedRequest, states: list[SubState], tok: TokenizerLike) -> Any:
    if req.kind == "generate":
        return native_body(req, states, tok)
    if req.kind == "completion":
        return completion_body(req, states, tok)
    return chat_body(req, states, tok)


# ---- streaming chunks --------------------------------------------------------------------------


class StreamShaper:
    """Turns per-sequence updates into SSE chunks for one HTTP request."""

    def __init__(self, req: ParsedRequest, tok: TokenizerLike) -> None:
        self.req = req
        self.tok = tok
        self.created = int(req.arrival_time)
        self._role_sent: set[int] = set()
        self._text_offset: dict[int, int] = {}
        self._content_sent: dict[int, int] = {}  # chat with tools: characters of s.text sent as content
        # chat with tools: per sequence, the calls begun in the stream (characters of arguments sent each)
        self._calls_sent: dict[int, list[int]] = {}
        self._scanners: dict[int, CallScanner] = {}  # chat with tools: each choice's calls, read as it grows

    def _openai(self, choice: dict, counted: SubState | None = None) -> bytes:
        """One chunk; with ``counted`` (continuous usage stats) it carries that choice's usage so
        far: its prompt and the tokens it has generated, as vLLM reports them per chunk."""
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        chunk = {"id": self.req.rid, "object": obj, "created": self.created, "model": self.req.model,
                 "choices": [choice]}
        if counted is not None:
            chunk["usage"] = _usage([counted], [counted])  # this choice's, so far
        return sse(chunk)

    def update(self, s: SubState, delta: str) -> list[bytes]:
        """Chunks for what ``s`` gained since the last call (``delta``: newly visible text)."""
        start, end = s.sent_tokens, len(s.output_ids)
        s.sent_tokens = end
        if self.req.kind == "generate":
            if not (delta or end > start or s.finished):
                return []
            return [sse(native_item(self.req, s, self.tok, stream=True))]
        reason, matched = _finish(s)
        counted = self.req.continuous_usage and end > start
        if not delta and reason is None and not (s.sub.return_logprob and end > start) and not counted:
            return []
        idx = s.sub.index
        chunks = []
        if self.req.kind == "chat":
            if idx not in self._role_sent:
                self._role_sent.add(idx)
                chunks.append(self._openai({"index": idx, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}))
            lp = chat_logprobs(s, self.tok, start, end) if s.sub.return_logprob else None
            delta_obj: dict = {"content": delta} if delta else {}
            if self.req.tools is not None:
                delta_obj, reason = self._tool_delta(s, reason)
                if not delta_obj and reason is None and lp is None and not counted:
                    return chunks
            choice = {"index": idx, "delta": delta_obj, "logprobs": lp, "finish_reason": reason}
        else:
            lp = None
            if s.sub.return_logprob:
                off = self._text_offset.get(idx, 0)
                lp = completion_logprobs(s, self.tok, start, end, off)
                self._text_offset[idx] = off + sum(len(p) for p in lp["tokens"])
            choice = {"index": idx, "text": delta, "logprobs": lp, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched
            _with_timeline(self.req, s, choice)
        chunks.append(self._openai(choice, s if self.req.continuous_usage else None))
        return chunks

    def _tool_delta(self, s: SubState, reason: str | None) -> tuple[dict, str | None]:
        """A chat stream with tools: content goes out up to where a tool call starts or may start
        (``stream_safe_len``); each call goes out as it is written, as OpenAI streams them: a
        delta with its index, id and name once the name is complete, then its arguments' text in
        fragments (``CallScanner``). At the end the calls parsed from the whole answer (the
        non-streamed ``tool_calls``) complete what was sent, and the finish reason becomes
        ``tool_calls``. A call the answer leaves malformed (cut by max_tokens, an unknown second
        function) is not taken back: its text is not also sent as content."""
        assert self.req.tools is not None
        idx = s.sub.index
        sent = self._content_sent.get(idx, 0)
        begun = self._calls_sent.setdefault(idx, [])
        out: dict = {}
        if not s.finished:
            upto = stream_safe_len(s.text, self.req.tools)
            self._content_sent[idx] = max(sent, upto)
            if upto > sent:
                out["content"] = s.text[sent:upto]
            deltas = []
            scanner = self._scanners.get(idx)
            if scanner is None:
                scanner = self._scanners[idx] = CallScanner(self.req.tools)
            for k, call in enumerate(scanner.feed(s.text)):
                if k == len(begun):  # its name is complete: the call's first delta
                    begun.append(len(call.args))
                    deltas.append({"index": k, "id": new_call_id(), "type": "function",
                                   "function": {"name": call.name, "arguments": call.args}})
                elif len(call.args) > begun[k]:
                    deltas.append({"index": k, "function": {"arguments": call.args[begun[k]:]}})
                    begun[k] = len(call.args)
            if deltas:
                out["tool_calls"] = deltas
            return out, reason
        content, calls = _tool_answer(self.req, s)
        self._content_sent[idx] = len(s.text)
        if not calls:
            if not begun and len(s.text) > sent:
                out["content"] = s.text[sent:]
            return out, reason
        # What was streamed as content is a prefix of the text before the first call.
        if content and len(content) > sent and content.startswith(s.text[:sent]):
            out["content"] = content[sent:]
        deltas = []
        for k, c in enumerate(calls):
            args = c["function"]["arguments"]
            if k >= len(begun):
                deltas.append({"index": k, **c})
            elif len(args) > begun[k]:
                deltas.append({"index": k, "function": {"arguments": args[begun[k]:]}})
        if deltas:
            out["tool_calls"] = deltas
        return out, "tool_calls"

    def usage_chunk(self, states: list[SubState]) -> bytes | None:
        if self.req.kind == "generate" or not self.req.include_usage:
            return None
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return sse({"id": self.req.rid, "object": obj, "created": self.created, "model": self.req.model,
                    "choices": [], "usage": usage(self.req, states)})
