"""``tool_choice: auto`` end to end: a model that writes a tool call on its own, through our router,
a prefill and a decode node (Mooncake over TCP), streamed and not, with the official ``openai``
client. A random-weight model never writes a call, so the checkpoint is a *scripted* tiny qwen3
(``make-tiny-model --script``: greedy output after any chat prompt is the given chunks, then EOS),
served by the session's ``scripted_routed`` cluster (tests/e2e/conftest.py).

The expected call is derived without our code: HF ``transformers`` renders the prompt with its own
tokenizer, HF greedy (tests/reference.py) generates to EOS, and a plain regex + ``json.loads``
reads the call out of HF's decoded text. The answer must be exactly that call, with
``finish_reason: tool_calls`` and no content; streamed, the client must see the name first and
then argument fragments, and assemble the same call.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import TOOL_CALL_SCRIPT, wait_idle

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}},
]
MESSAGES = [{"role": "user", "content": "what time is it in Paris?"}]


def reference_calls(model_dir: str) -> list[tuple[str, dict]]:
    """HF's greedy answer to the same request, its calls read by a plain regex."""
    from transformers import AutoTokenizer

    from tests.reference import hf_greedy

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    out, _ = hf_greedy(model_dir, ids, 64, stop_on_eos=True)
    text = tok.decode(out, skip_special_tokens=True)
    calls = [json.loads(m) for m in re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.S)]
    return [(c["name"], c["arguments"]) for c in calls]


def test_auto_tool_call_from_the_model_is_parsed_streamed_and_not(scripted_routed: tuple[LocalCluster, str],
                                                                 tiny_model_factory: Callable[..., str]) -> None:
    cluster, url = scripted_routed
    model_dir = tiny_model_factory("qwen3", script=TOOL_CALL_SCRIPT)  # the cluster's checkpoint (built once)
    want = reference_calls(model_dir)
    assert want == [("get_time", {"tz": "CET"})]  # the scripted model does write one call
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        body: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "temperature": 0}
        whole = client.chat.completions.create(**body)
        fragments = []
        with client.chat.completions.stream(**body) as stream:
            for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    fragments.append(event.arguments_delta)
            streamed = stream.get_final_completion()
        for resp in (whole, streamed):
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
            assert got == want, (got, want)
        assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
        # How many fragments arrive depends on how the stream coalesces tokens (timing); the fragments
        # themselves must add up to the call (tests/unit/test_tools.py checks one per token).
        assert fragments and "".join(fragments) == whole.choices[0].message.tool_calls[0].function.arguments
        for n in cluster.nodes:
            wait_idle(n.url)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
