"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

::

    parse (API process)   tools checked (names, parameter schemas compiled like any json_schema)
                          -> rendered by the model's chat template (``tools=``)
                          tool_choice required / named -> a grammar (Lark, ``SamplingParams.ebnf``)
                          holding the output to tool calls whose arguments follow the function's
                          schema; auto -> free output; none -> neither parsed nor constrained
    answer                tool calls parsed out of the text -> ``message.tool_calls``, finish_reason
                          ``tool_calls``; ``arguments`` is the JSON text the model wrote, verbatim
    stream                ``delta.tool_calls`` as the calls are written: a call's id and name once
                          its name is complete, then its arguments' text in fragments
                          (``CallScanner``), so the assembled calls equal the whole answer's

Two conventions, chosen by the chat template (a template that mentions ``<tool_call>`` is the
Qwen/Hermes one)::

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
    llama3   {"name": "f", "parameters": {...}}                            (the whole answer;
             optionally after <|python_tag|>; several joined by ";")

The grammar is plain text in the request like any other, so the prefill and the decode compile
the same one (docs/ARCHITECTURE.md, "Structured outputs").
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from common.server.errors import bad_request

Convention = Literal["hermes", "llama3"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # OpenAI's tool objects, as the template receives them
    params: dict[str, dict]  # function name -> its parameters schema
    choice: Literal["auto", "required", "named"]  # tool_choice "none" makes no plan
    name: str | None  # the named function
    parallel: bool
    convention: Convention

    def grammar(self) -> str | None:
        """Lark for required / named (None for auto): the answer is one call (or, with
        ``parallel_tool_calls``, one or more for ``required``) whose arguments follow the schema."""
        if self.choice == "auto":
            return None
        names = [self.name] if self.choice == "named" else list(self.params)
        key = "arguments" if self.convention == "hermes" else "parameters"
        # Compact JSON, as for response_format (llguidance.py says why).
        calls = [{"type": "object", "properties": {"name": {"const": n}, key: self.params[n]},
                  "required": ["name", key], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}} for n in names]
        rules = [f"call{i}: %json {json.dumps(c)}" for i, c in enumerate(calls)]
        one = " | ".join(f"call{i}" for i in range(len(calls)))
        many = self.parallel and self.choice == "required"
        if self.convention == "hermes":
            block = f'"{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"'
            start = f'start: block ("\\n" block)*\nblock: {block}' if many else f"start: {block}"
        else:
            start = 'start: body (";" body)*' if many else "start: body"
        return "\n".join([start, f"body: {one}", *rules]) + "\n"


def convention_of(chat_template: str | None) -> Convention:
    return "hermes" if chat_template and HERMES_OPEN in chat_template else "llama3"


def parse_tools(body: dict, chat_template: str | None, check_schema: Any) -> ToolPlan | None:
    """The request's tool plan, None when it has no tools or says ``tool_choice: "none"``.
    ``check_schema(schema_text) -> reason | None`` is the parse-time grammar check."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects")
    params: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'")
        if name in params:
            raise bad_request(f"tools[{i}]: a second function named {name!r}")
        schema = fn.get("parameters", _EMPTY_PARAMS)
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object")
        reason = check_schema(json.dumps(schema))
        if reason is not None:
            raise bad_request(f"tools[{i}].function.parameters: {reason}")
        params[name] = schema
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean")
    named = None
    if choice in (None, "auto"):
        kind = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        kind = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named, kind = choice["function"].get("name"), "named"
        if named not in params:
            raise bad_request(f"'tool_choice' names {named!r}, which is not one of the tools ({', '.join(params)})")
    else:
        raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return ToolPlan(tools=tools, params=params, choice=kind, name=named, parallel=parallel,  # type: ignore[arg-type]
                    convention=convention_of(chat_template))


# ---- the answer ----------------------------------------------------------------------------------

# The head of a call object as the templates ask for it and the grammars emit it: the name first,
# then the arguments (Llama 3 calls them "parameters"). A call written in another key order is
# still parsed, only not streamed before it is whole.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ObjectScan:
    """Where a JSON object ends, read a piece at a time: between pieces the scan keeps its depth
    and whether it is inside a string (and just after a backslash there). Only strings and
    braces matter: the model's JSON is checked whole by json.loads."""

    __slots__ = ("depth", "in_str", "escaped", "end")

    def __init__(self) -> None:
        self.depth, self.in_str, self.escaped = 0, False, False
        self.end: int | None = None  # one past the closing brace, from the object's start

    def feed(self, piece: str, offset: int) -> None:
        """``piece`` continues the object ``offset`` characters after its start."""
        for i, ch in enumerate(piece):
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = offset + i + 1
                    return


def _object_end(text: str) -> int | None:
    """Where the JSON object that ``text`` starts with ends (one past its ``}``), None while it is
    still open."""
    scan = _ObjectScan()
    scan.feed(text, 0)
    return scan.end


@dataclass(frozen=True)
class CallText:
    """One tool call as far as the answer has written it."""
    name: str  # complete, and one of the plan's functions
    args: str  # the arguments' JSON text so far (all of it once ``done``)
    done: bool
    end: int  # where the text read for it ends, relative to where it began


class _Region:
    """The call a region of the answer (``text[start:limit]``) begins with, kept between reads
    of a growing answer: the head is matched again only until the arguments' first character
    is written (white space after its colon may still grow it; it is short), then only the
    arguments' new characters are scanned."""

    __slots__ = ("start", "name", "args_at", "scan", "scanned")

    def __init__(self, start: int) -> None:
        self.start = start
        self.name = ""
        self.args_at = -1  # where the arguments' "{" stands, once written
        self.scan = _ObjectScan()
        self.scanned = 0  # how far the scan has read

    def call(self, text: str, limit: int, plan: ToolPlan) -> CallText | None:
        """The call once its name is written and known; None before that, or when the region
        does not start like a call (then it is only parsed whole, at the end)."""
        if self.args_at < 0:
            head = _HEAD.match(text, self.start, limit)
            if head is None:
                return None
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return None
            if name not in plan.params:
                return None
            if head.end() == limit:
                return CallText(name, "", False, limit - self.start)
            if text[head.end()] != "{":
                return None
            self.name, self.args_at = name, head.end()
            self.scanned = self.args_at
        if self.scan.end is None and limit > self.scanned:
            self.scan.feed(text[self.scanned: limit], self.scanned - self.args_at)
            self.scanned = limit
        if self.scan.end is None:
            return CallText(self.name, text[self.args_at: limit], False, limit - self.start)
        end = self.args_at + self.scan.end
        return CallText(self.name, text[self.args_at: end], True, end - self.start)


_LEADING_SPACE = re.compile(r"\s*")
_NEXT_CALL = re.compile(r"\s*\}\s*;")  # llama3: the call object's own "}" and the ";" before the next


class CallScanner:
    """The calls a partial answer has begun, in order, up to the first one not (yet)
    streamable: what a stream may send as ``delta.tool_calls`` before the answer is finished.

    One per streamed answer, ``feed`` with the whole text so far each time: the answer only
    grows, so what was read of it is kept and each character is scanned once (re-reading the
    whole answer at every token cost time quadratic in its length). A text that does not
    extend the last one starts the scan over."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._reset()

    def _reset(self) -> None:
        self._text = ""
        self._regions: dict[int, _Region] = {}
        self._opens: list[int] = []  # hermes: where each <tool_call> ends
        self._closes: dict[int, int] = {}  # hermes: an open's end -> where its </tool_call> starts
        self._searched = 0  # hermes: how far the text was searched for tags

    def feed(self, text: str) -> list[CallText]:
        if not text.startswith(self._text):
            self._reset()
        self._text = text
        return self._hermes(text) if self.plan.convention == "hermes" else self._llama3(text)

    def _region(self, start: int) -> _Region:
        r = self._regions.get(start)
        if r is None:
            r = self._regions[start] = _Region(start)
        return r

    def _hermes(self, text: str) -> list[CallText]:
        # A tag may have been cut between two reads: search again from a tag's length back.
        back = max(len(HERMES_OPEN), len(HERMES_CLOSE)) - 1
        i = max(self._searched - back, self._opens[-1] if self._opens else 0)
        while (j := text.find(HERMES_OPEN, i)) >= 0:
            i = j + len(HERMES_OPEN)
            self._opens.append(i)
        out: list[CallText] = []
        for start in self._opens:
            close = self._closes.get(start)
            if close is None:
                found = text.find(HERMES_CLOSE, max(start, self._searched - back))
                if found >= 0:
                    close = self._closes[start] = found
            call = self._region(start).call(text, len(text) if close is None else close, self.plan)
            if call is None:
                break
            out.append(call)
        self._searched = len(text)
        return out

    def _llama3(self, text: str) -> list[CallText]:
        start = _LEADING_SPACE.match(text).end()  # type: ignore[union-attr]
        if text.startswith(PYTHON_TAG, start):
            start += len(PYTHON_TAG)
        out: list[CallText] = []
        while True:
            call = self._region(start).call(text, len(text), self.plan)
            if call is None:
                break
            out.append(call)
            rest = _NEXT_CALL.match(text, start + call.end) if call.done else None
            if rest is None:
                break
            start = rest.end()
        return out


def call_prefixes(text: str, plan: ToolPlan) -> list[CallText]:
    """``CallScanner.feed`` of a whole text at once."""
    return CallScanner(plan).feed(text)


def _call(name: Any, args: Any, text: str) -> dict | None:
    """An OpenAI tool call; ``arguments`` is the arguments' text as written in ``text`` (the call
    object) when it reads back to ``args``, so a stream's fragments add up to it."""
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    head = _HEAD.match(text)
    end = _object_end(text[head.end():]) if head else None
    raw = text[head.end(): head.end() + end] if head and end else None
    try:
        verbatim = raw is not None and json.loads(raw) == args
    except ValueError:
        verbatim = False
    if raw is None or not verbatim:
        raw = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": raw}}


def extract_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content left once the calls are taken out, or None; the calls). Text that holds no
    complete, well-formed call of a known function comes back whole as content, with no calls."""
    calls: list[dict] = []
    if plan.convention == "hermes":
        pattern = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)
        for m in pattern.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return text, []
            call = _call(obj.get("name"), obj.get("arguments", {}), m.group(1)) if isinstance(obj, dict) else None
            if call is None or obj.get("name") not in plan.params:
                return text, []
            calls.append(call)
        rest = pattern.sub("", text).strip() if calls else text
    else:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        for part in body.split(";"):
            try:
                obj = json.loads(part)
            except ValueError:
                return text, []
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            call = _call(obj.get("name") if isinstance(obj, dict) else None, args, part.strip())
            if call is None or obj.get("name") not in plan.params:
                return text, []
            calls.append(call)
        rest = ""
    return (rest or None) if calls else text, calls


def stream_safe_len(text: str, plan: ToolPlan) -> int:
    """How much of a streamed answer may go out as content before it is finished: everything up
    to where a tool call starts or might start (a partial ``<tool_call>``, or for llama3 an answer
    that begins like a JSON call), the rest held until the end."""
    if plan.convention == "llama3":
        head = text.lstrip()
        return 0 if not head or head[0] == "{" or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]) else len(text)
    i = text.find(HERMES_OPEN)
    if i >= 0:
        return i
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
