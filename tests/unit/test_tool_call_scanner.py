"""The streamed tool-call scanner (``common.server.tools.CallScanner``): fed a growing answer,
it must say at every length what a fresh, whole-text parse says, while reading each character
of the arguments once (re-reading the answer at every token was quadratic in its length).

The reference below is the stateless parser the scanner replaced: it re-reads the whole text
each time (regions between tags, the head regex, a brace and string scan of the arguments)."""
from __future__ import annotations

import json
import random
import re

import pytest

from common.server import tools
from common.server.tools import HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG, CallScanner, CallText, ToolPlan

PARAMS = {"get_weather": {"type": "object"}, "get_time": {"type": "object"}}


def _plan(convention: str) -> ToolPlan:
    return ToolPlan([], PARAMS, "auto", None, True, convention)  # type: ignore[arg-type]


def _ref_object_end(text: str) -> int | None:
    depth, in_str, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _ref_call_text(region: str, plan: ToolPlan) -> CallText | None:
    head = tools._HEAD.match(region)
    if head is None:
        return None
    try:
        name = json.loads(head.group(1))
    except ValueError:
        return None
    if name not in plan.params:
        return None
    args = region[head.end():]
    if args and not args.startswith("{"):
        return None
    end = _ref_object_end(args)
    return CallText(name, args if end is None else args[:end], end is not None,
                    len(region) if end is None else head.end() + end)


def _reference(text: str, plan: ToolPlan) -> list[CallText]:
    out: list[CallText] = []
    if plan.convention == "hermes":
        for m in re.finditer(re.escape(HERMES_OPEN), text):
            close = text.find(HERMES_CLOSE, m.end())
            call = _ref_call_text(text[m.end(): len(text) if close < 0 else close], plan)
            if call is None:
                break
            out.append(call)
        return out
    body = text.lstrip().removeprefix(PYTHON_TAG)
    while True:
        call = _ref_call_text(body, plan)
        if call is None:
            break
        out.append(call)
        rest = re.match(r"\s*\}\s*;", body[call.end:]) if call.done else None
        if rest is None:
            break
        body = body[call.end + rest.end():]
    return out


def _args(rng: random.Random, depth: int = 0) -> str:
    """JSON-ish argument text with the characters the scan must get right: nested braces and
    brackets, strings holding braces, quotes and backslashes, and tags inside strings."""
    parts = []
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(['"city"', '"q"', '"a\\"b"', '"{k}"'])
        value = rng.choice(['"Oslo"', '"x\\\\"', '"}{"', '"\\"]"', "12", "[1, {\"n\": [2]}]", '"' + HERMES_CLOSE + '"',
                            '"' + HERMES_OPEN + '"', "true"])
        if depth < 2 and rng.random() < 0.3:
            value = _args(rng, depth + 1)
        parts.append(f"{key}:{rng.choice(['', ' '])}{value}")
    return "{" + ", ".join(parts) + "}"


def _call(rng: random.Random, convention: str) -> str:
    name = rng.choice(["get_weather", "get_time", "unknown_fn"] if rng.random() < 0.1 else ["get_weather", "get_time"])
    key = "arguments" if convention == "hermes" else rng.choice(["parameters", "arguments"])
    ws = rng.choice(["", " ", "\n "])
    args = _args(rng)
    if rng.random() < 0.1:
        args = args[: rng.randint(0, len(args))]  # cut short: never closes
    return f'{{"name":{ws}{json.dumps(name)},{ws}"{key}":{ws}{args}}}'


def _answer(rng: random.Random, convention: str) -> str:
    if convention == "hermes":
        out = rng.choice(["", "Let me look. ", "I think <tool_ "])
        for _ in range(rng.randint(1, 3)):
            out += f"{HERMES_OPEN}{rng.choice(['', chr(10)])}{_call(rng, convention)}{rng.choice(['', chr(10)])}{HERMES_CLOSE}"
            out += rng.choice(["", "\n", " and "])
        return out
    calls = [_call(rng, convention) for _ in range(rng.randint(1, 3))]
    return rng.choice(["", "  ", PYTHON_TAG, " " + PYTHON_TAG]) + rng.choice([";", "; ", " ;\n"]).join(calls)


@pytest.mark.parametrize("convention", ["hermes", "llama3"])
def test_the_scanner_fed_piece_by_piece_says_what_a_whole_parse_says(convention: str) -> None:
    rng = random.Random(f"scanner-{convention}")
    plan = _plan(convention)
    seen_calls = seen_done = 0
    for _ in range(300):
        text = _answer(rng, convention)
        scanner, k = CallScanner(plan), 0
        while k < len(text):
            k = min(len(text), k + rng.choice([1, 1, 2, 3, 7]))  # tokens of a few characters
            got = scanner.feed(text[:k])
            assert got == _reference(text[:k], plan), (text, k)
        seen_calls += len(got)
        seen_done += sum(c.done for c in got)
        assert CallScanner(plan).feed(text) == _reference(text, plan)  # one read of the whole text too
    assert seen_calls > 300 and seen_done > 200  # the draw reaches calls and finished calls


def test_a_text_that_does_not_extend_the_last_one_starts_over() -> None:
    plan = _plan("hermes")
    scanner = CallScanner(plan)
    first = f'{HERMES_OPEN}{{"name": "get_time", "arguments": {{"tz": "CET"'
    assert [c.args for c in scanner.feed(first)] == ['{"tz": "CET"']
    other = f'{HERMES_OPEN}{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}'
    assert scanner.feed(other) == _reference(other, plan)


@pytest.mark.parametrize("convention", ["hermes", "llama3"])
def test_each_character_of_long_arguments_is_scanned_once(convention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scanned = 0
    feed = tools._ObjectScan.feed

    def counting(self: tools._ObjectScan, piece: str, offset: int) -> None:
        nonlocal scanned
        scanned += len(piece)
        feed(self, piece, offset)

    monkeypatch.setattr(tools._ObjectScan, "feed", counting)
    long_value = "word " * 4000  # 20,000 characters of one string argument
    head = HERMES_OPEN if convention == "hermes" else ""
    text = head + '{"name": "get_weather", "arguments": {"notes": "' + long_value + '"}}'
    scanner = CallScanner(_plan(convention))
    for k in range(0, len(text) + 1, 4):  # a token of four characters at a time: ~5,000 reads
        scanner.feed(text[:k])
    [call] = scanner.feed(text)
    assert call.done and json.loads(call.args) == {"notes": long_value}
    assert scanned <= len(text)  # re-reading at every token would have scanned ~5,000 times as much
