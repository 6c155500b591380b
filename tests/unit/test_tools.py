"""Tool calling in the API process: parsing and checking ``tools`` / ``tool_choice``, the template
rendering them, the grammar that ``required`` and named choices compile to, and tool calls parsed
out of an answer (whole and streamed) into OpenAI's ``tool_calls``."""
from __future__ import annotations

import json
from typing import Any

import pytest

from common.grammar.factory import load_backend
from common.grammar.spec import GrammarSpec
from common.ipc.protocol import ReqOutput
from common.request import FinishReason
from common.server.config import ApiConfig
from common.server.errors import ApiError
from common.server.outputs import SubState
from common.server.parse_openai import parse_chat
from common.server.responses import StreamShaper, chat_body
from common.server.tools import ToolPlan, extract_tool_calls, stream_safe_len
from common.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                      "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def cfg(tiny_qwen3: str) -> ApiConfig:
    return ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=1024)


def chat(cfg: ApiConfig, tok: Tokenizer, **body: Any) -> Any:
    return parse_chat({"messages": MSGS, **body}, cfg, tok)


@pytest.mark.parametrize("body,needle", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "not one of the tools"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}, "then": {}}}}]},
     "tools[0].function.parameters: invalid json_schema: Unimplemented keys"),
    ({"tools": [WEATHER, WEATHER]}, "second function"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "drop 'response_format'"),
])
def test_bad_tool_requests_are_400s(cfg: ApiConfig, tok: Tokenizer, body: dict, needle: str) -> None:
    with pytest.raises(ApiError) as ei:
        chat(cfg, tok, **body)
    assert ei.value.status == 400 and needle in ei.value.message, ei.value.message


def test_tools_are_rendered_and_required_named_choices_become_grammars(cfg: ApiConfig, tok: Tokenizer) -> None:
    plain = chat(cfg, tok)
    auto = chat(cfg, tok, tools=[WEATHER, TIME])
    assert "<tools>" in tok.decode(auto.subs[0].input_ids) and "<tools>" not in tok.decode(plain.subs[0].input_ids)
    assert auto.tools is not None and auto.tools.convention == "hermes" and auto.subs[0].sampling.ebnf is None
    none = chat(cfg, tok, tools=[WEATHER], tool_choice="none")
    assert none.tools is None and none.subs[0].input_ids == plain.subs[0].input_ids
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        req = chat(cfg, tok, tools=[WEATHER, TIME], tool_choice=choice)
        assert req.subs[0].sampling.ebnf and req.tools is not None


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("required", True, '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>', True),
    ("required", True, '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>\n'
                       '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":2}}\n</tool_call>', True),
    ("required", False, '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>\n<tool_call>', False),
    ("required", True, '<tool_call>\n{"name":"get_time","arguments":{"tz":"PST"}}\n</tool_call>', False),
    ("named", True, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":9}}\n</tool_call>', False),
    ("named", True, '<tool_call>\n{"name":"get_time","arguments":{"tz":"CET"}}\n</tool_call>', False),
    ("named", True, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":3}}\n</tool_call>', True),
    ("named", True, 'Sure: <tool_call>', False),
])
def test_the_tool_grammar_admits_exactly_valid_calls(tok: Tokenizer, choice: str, parallel: bool, text: str,
                                                     ok: bool) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    plan = ToolPlan([WEATHER, TIME], params, choice, "get_weather" if choice == "named" else None, parallel,  # type: ignore[arg-type]
                    "hermes")
    be = load_backend("llguidance", tok.backend_json(), tok.vocab_size, sorted(tok.eos_token_ids), threads=1)
    m = be.matcher(be.compile(GrammarSpec("ebnf", plan.grammar() or "")))  # type: ignore[union-attr]
    ids = tok.encode(text, add_special_tokens=False)
    # Complete: nothing may follow, or (parallel calls) another call or the end may.
    assert (all(m.consume(t) for t in ids) and (m.is_done() or m.m.is_accepting())) is ok  # type: ignore[attr-defined]


def _plan(convention: str = "hermes") -> ToolPlan:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    return ToolPlan([WEATHER, TIME], params, "auto", None, True, convention)  # type: ignore[arg-type]


def test_tool_calls_are_parsed_out_of_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    content, calls = extract_tool_calls(text, _plan())
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"tz": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for not_a_call in ("just text", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
                       '<tool_call>\n{"name": "get_time", "arguments": \n</tool_call>'):
        assert extract_tool_calls(not_a_call, _plan()) == (not_a_call, [])
    content, calls = extract_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}', _plan("llama3"))
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"tz": "CET"}
    assert stream_safe_len("abc <tool_c", _plan()) == 4 and stream_safe_len("abc", _plan()) == 3
    assert stream_safe_len('{"name"', _plan("llama3")) == 0 and stream_safe_len("Hi", _plan("llama3")) == 2


ANSWER = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def _state(cfg: ApiConfig, tok: Tokenizer, stream: bool) -> tuple[Any, SubState]:
    req = chat(cfg, tok, tools=[WEATHER, TIME], stream=stream)
    return req, SubState.new(req.subs[0], tok)


def test_an_auto_answer_with_a_tool_call_becomes_tool_calls(cfg: ApiConfig, tok: Tokenizer) -> None:
    req, s = _state(cfg, tok, False)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=ids, finish=FinishReason(type="stop", matched=2)))
    [choice] = chat_body(req, [s], tok)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["days"] == 2
    # Cut short by max_tokens: no call, the text as content.
    req, s = _state(cfg, tok, False)
    s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=ids[:-3], finish=FinishReason(type="length", length=len(ids) - 3)))
    [choice] = chat_body(req, [s], tok)["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


def _stream(cfg: ApiConfig, tok: Tokenizer, text: str, finish: FinishReason | None = None,
            tools: list[dict] | None = None) -> tuple[list[dict], dict]:
    """The chunks of ``text`` streamed one token per update, and the whole answer's choice for the
    same text (what the non-streamed request would return)."""
    ids = tok.encode(text, add_special_tokens=False)
    finish = finish or FinishReason(type="stop", matched=2)
    req, s = _state(cfg, tok, True)
    if tools is not None:
        req = chat(cfg, tok, tools=tools, stream=True)
        s = SubState.new(req.subs[0], tok)
    shaper = StreamShaper(req, tok)
    chunks: list[dict] = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        delta = s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=[t], finish=finish if last else None))
        chunks += [json.loads(c.decode()[6:]) for c in shaper.update(s, delta)]
    whole_req = chat(cfg, tok, tools=tools or [WEATHER, TIME])
    whole = SubState.new(whole_req.subs[0], tok)
    whole.apply(ReqOutput(rid=whole.sub.rid, new_token_ids=ids, finish=finish))
    return chunks, chat_body(whole_req, [whole], tok)["choices"][0]


def _assemble(chunks: list[dict]) -> list[dict]:
    """Tool-call deltas merged by index the way OpenAI's clients do: the first delta of an index
    brings id, type and name; arguments are concatenated."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c["choices"][0]["delta"].get("tool_calls") or []:
            if tc["index"] not in calls:
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


def _names_args(choice: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]


TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
             '\n<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>')


@pytest.mark.parametrize("text", [ANSWER, TWO_CALLS])
def test_streamed_tool_calls_go_out_as_name_then_argument_fragments(cfg: ApiConfig, tok: Tokenizer, text: str) -> None:
    chunks, whole = _stream(cfg, tok, text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content in ("Checking.\n", "Checking.") and "<tool_call" not in content  # nothing of a call leaked
    calls = _assemble(chunks)
    # The assembled calls equal the whole answer's, arguments byte for byte (the text the model wrote).
    assert [(c["name"], c["arguments"]) for c in calls] == _names_args(whole) != []
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 2}
    # Incremental: the name goes out before the arguments are complete, which then come in
    # several fragments, each before the answer finished.
    fragments = [(i, tc) for i, c in enumerate(chunks) for tc in c["choices"][0]["delta"].get("tool_calls") or []
                 if tc["index"] == 0]
    assert fragments[0][1]["function"]["name"] == "get_weather" and len(fragments) >= 4
    assert fragments[0][1]["function"]["arguments"] != calls[0]["arguments"]
    assert sum(1 for i, _ in fragments if i < len(chunks) - 1) >= 3  # before the finishing chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" == whole["finish_reason"]


def test_streamed_tool_calls_in_the_llama3_convention(cfg: ApiConfig, tok: Tokenizer) -> None:
    text = '{"name": "get_time", "parameters": {"tz": "CET"}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}'
    plan = ToolPlan([WEATHER, TIME], {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)},
                    "auto", None, True, "llama3")
    from common.server.tools import call_prefixes

    prefixes = [call_prefixes(text[:k], plan) for k in range(len(text) + 1)]
    assert [c.name for c in prefixes[-1]] == ["get_time", "get_weather"] and all(c.done for c in prefixes[-1])
    assert prefixes[-1][1].args == '{"city": "Rome", "days": 1}'
    # Each prefix's argument text only grows, and the name appears before the arguments end.
    first_name = next(k for k, p in enumerate(prefixes) if p)
    assert prefixes[first_name][0].args == "" and not prefixes[first_name][0].done
    content, calls = extract_tool_calls(text, plan)
    assert content is None and [c["function"]["arguments"] for c in calls] == [c.args for c in prefixes[-1]]


def test_a_streamed_call_cut_short_keeps_what_was_sent(cfg: ApiConfig, tok: Tokenizer) -> None:
    text = ANSWER[: ANSWER.index('"days"')]
    chunks, whole = _stream(cfg, tok, text, FinishReason(type="length", length=len(tok.encode(text, add_special_tokens=False))))
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    [call] = _assemble(chunks)
    assert call["name"] == "get_weather" and call["arguments"].rstrip() == '{"city": "Oslo",'
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "<tool_call" not in content and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_llama3_convention_grammar_and_parse(tok: Tokenizer) -> None:
    """A template without <tool_call> (Llama 3): required/named constrain to a bare JSON call with
    "parameters", which the parser reads back."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    plan = ToolPlan([WEATHER, TIME], params, "named", "get_time", False, "llama3")
    be = load_backend("llguidance", tok.backend_json(), tok.vocab_size, sorted(tok.eos_token_ids), threads=1)
    m = be.matcher(be.compile(GrammarSpec("ebnf", plan.grammar() or "")))  # type: ignore[union-attr]
    text = '{"name":"get_time","parameters":{"tz":"JST"}}'
    assert not all(m.consume(t) for t in tok.encode(text, add_special_tokens=False))  # JST is not in the enum
    m = be.matcher(be.compile(GrammarSpec("ebnf", plan.grammar() or "")))  # type: ignore[union-attr]
    text = '{"name":"get_time","parameters":{"tz":"CET"}}'
    assert all(m.consume(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_done()
    content, [call] = extract_tool_calls(text, plan)
    assert content is None and json.loads(call["function"]["arguments"]) == {"tz": "CET"}
