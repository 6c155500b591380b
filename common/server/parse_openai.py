"""Parse OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies into a ``ParsedRequest``.

Accepts what sglang-router 0.3.2 rebuilds (``"model": null``/``"unknown"``, ``max_completion_tokens``,
many default fields) and the SGLang/vLLM extras benchmark clients send (``ignore_eos``,
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``seed``, ``n``, logprobs,
``stream_options.include_usage``). Unknown fields are ignored; known features we do not
implement (legacy ``functions``, echo, structural tags, ...) are rejected with 400 rather than
silently producing different output. ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` on chat:
``common.server.tools``.

Structured outputs: ``response_format`` ``{"type": "json_object"}`` (any JSON object) and
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, and SGLang's extras
``json_schema`` / ``regex`` / ``ebnf`` at the top level; at most one per request. They become the
``SamplingParams`` grammar fields (common/grammar).

With ``n > 1`` and a ``seed``, sample j uses ``seed + j`` (``parse_common.sample_seed``) so the n
choices differ yet stay reproducible.
"""
from __future__ import annotations

import uuid
from typing import Any

from common.grammar.factory import check_spec
from common.grammar.spec import JSON_OBJECT_SCHEMA, GrammarSpec, schema_text
from common.request import InvalidRequest
from common.server.config import ApiConfig
from common.server.errors import bad_request
from common.server.parse_common import (
    ParsedRequest,
    SubRequest,
    as_id_list,
    build_sampling,
    expand_bootstrap,
    finalize_sub,
    get_bool,
    get_int,
    all_ints,
    make_rids,
    reject_unsupported,
)
from common.server.textio import TokenizerLike
from common.server.tools import ToolPlan, parse_tools

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "seed", "skip_special_tokens")
_UNSUPPORTED = ("structural_tag", "suffix", "echo",
                "no_stop_trim", "lora_path", "session_params", "return_hidden_states",
                "functions", "continue_final_message")


def _common(body: Any, cfg: ApiConfig) -> tuple[int, bool, tuple[bool, bool]]:
    """(n, stream, (include_usage, continuous_usage_stats)) after the checks both endpoints share."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    reject_unsupported(body, _UNSUPPORTED)
    n = get_int(body, "n", 1)
    assert n is not None
    if n < 1:
        raise bad_request(f"'n' must be >= 1, got {n}")
    if n > cfg.max_n:
        raise bad_request(f"'n' is {n}; this server allows at most {cfg.max_n} (--max-n)")
    best_of = get_int(body, "best_of")
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' different from 'n' is not supported by this server")
    stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object")
    include_usage = get_bool(opts or {}, "include_usage")
    # vLLM's extension, which benchmark clients use for exact token counts per chunk.
    continuous = get_bool(opts or {}, "continuous_usage_stats")
    return n, stream, (include_usage, continuous)


def _max_tokens(body: dict, default: int) -> int:
    # The router rebuilds max_tokens as max_completion_tokens; OpenAI deprecated max_tokens.
    v = get_int(body, "max_completion_tokens")
    if v is None:
        v = get_int(body, "max_tokens")
    if v is None:
        return default
    if v < 0:
        raise bad_request(f"'max_tokens' must be >= 0, got {v}")
    return v


def _logit_bias(v: Any) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` (JSON keys are strings) as ``{token id: bias}``."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to numbers")
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(f"'logit_bias' key {k!r} is not a token id") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad_request(f"'logit_bias' value for token {k} must be a number")
        out[tid] = float(b)
    return out


def _grammar(body: dict) -> dict[str, str | None]:
    """The grammar fields of SamplingParams from ``response_format`` or SGLang's top-level extras."""
    out: dict[str, Any] = {k: body.get(k) for k in ("json_schema", "regex", "ebnf")}
    fmt = body.get("response_format")
    if fmt is None:
        return out
    if not isinstance(fmt, dict):
        raise bad_request("'response_format' must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return out
    if any(v is not None for v in out.values()):
        raise bad_request("give either 'response_format' or one of 'json_schema', 'regex', 'ebnf', not both")
    if kind == "json_object":
        out["json_schema"] = JSON_OBJECT_SCHEMA
        return out
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("'response_format.json_schema.name' must be a string")
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean")
    schema = js.get("schema")
    # OpenAI makes the schema optional: without one the answer is any JSON object. strict asks
    # OpenAI to hold the output to the schema exactly, which constrained decoding always does.
    try:
        out["json_schema"] = JSON_OBJECT_SCHEMA if schema is None else schema_text(schema, "'response_format.json_schema.schema'")
    except InvalidRequest as exc:
        raise bad_request(str(exc)) from exc
    return out


def _fan_out(kind: str, body: dict, cfg: ApiConfig, tok: TokenizerLike, prompts: list[list[int]], n: int,
             max_new: int, logprob: bool, top: int, stream: bool, usage_opts: tuple[bool, bool],
             tools: ToolPlan | None = None) -> ParsedRequest:
    count = len(prompts) * n
    if count > cfg.max_batch_size:
        raise bad_request(f"{count} sequences in one request; the limit is {cfg.max_batch_size}")
    fields = {k: body.get(k) for k in _SAMPLING_KEYS}
    fields["max_new_tokens"] = max_new
    fields["logit_bias"] = _logit_bias(body.get("logit_bias"))
    fields["min_new_tokens"] = body.get("min_tokens")  # vLLM's name for SGLang's min_new_tokens
    fields.update(_grammar(body))
    tool_grammar = tools.grammar() if tools is not None else None
    if tool_grammar is not None:  # tool_choice required / named: the calls are the grammar
        if any(fields[k] is not None for k in ("json_schema", "regex", "ebnf")):
            raise bad_request("tool_choice required or a named function constrains the output already: "
                              "drop 'response_format' (or json_schema / regex / ebnf)")
        fields["ebnf"] = tool_grammar
    build_sampling(fields)  # type errors once, before the fan-out
    boots = expand_bootstrap(body, count, cfg.bootstrap_port)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    parent, rids = make_rids(body.get("rid"), count, prefix + uuid.uuid4().hex)
    subs = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            idx = i * n + j
            sampling = build_sampling(fields)
            host, port, room = boots[idx]
            sub = SubRequest(rid=rids[idx], index=idx, input_ids=ids, sampling=sampling, bootstrap_host=host,
                             bootstrap_port=port, bootstrap_room=room, return_logprob=logprob,
                             top_logprobs_num=top)
            finalize_sub(sub, cfg, tok.vocab_size, sample=j)
            subs.append(sub)
    return ParsedRequest(kind=kind, rid=parent, subs=subs, stream=stream,  # type: ignore[arg-type]
                         model=cfg.model_name, n=n, include_usage=usage_opts[0],
                         continuous_usage=usage_opts[1],
                         return_timeline=get_bool(body, "return_timeline"), tools=tools)


def parse_completion(body: Any, cfg: ApiConfig, tok: TokenizerLike) -> ParsedRequest:
    n, stream, usage_opts = _common(body, cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all_ints(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [as_id_list(p, "'prompt' entries") for p in prompt]
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a "
                          "list of such lists (non-empty)")
    top = get_int(body, "logprobs")  # completions: an int (how many alternatives), or null
    if top is not None and not 0 <= top <= 20:
        raise bad_request(f"'logprobs' must be in [0, 20], got {top}")
    return _fan_out("completion", body, cfg, tok, prompts, n, _max_tokens(body, cfg.completion_default_max_tokens),
                    top is not None, top or 0, stream, usage_opts)


def _check_message(i: int, msg: Any) -> dict:
    """Shape checks with the message's index in the error; content parts are flattened by the
    tokenizer's chat template wrapper."""
    if not isinstance(msg, dict):
        raise bad_request(f"messages[{i}] must be an object")
    role = msg.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"messages[{i}].role must be a non-empty string")
    content = msg.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"messages[{i}].content must be a string, a list of content parts or null")
    return {**msg, "content": "" if content is None else content}


def parse_chat(body: Any, cfg: ApiConfig, tok: TokenizerLike) -> ParsedRequest:
    n, stream, usage_opts = _common(body, cfg)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list")
    msgs = [_check_message(i, m) for i, m in enumerate(messages)]
    tools = parse_tools(body, getattr(tok, "chat_template", None),
                        lambda schema: check_spec(GrammarSpec("json_schema", schema), cfg.grammar_backend))
    extra = {"tools": tools.tools} if tools is not None else {}
    try:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **extra)
    except InvalidRequest as exc:  # no template, or the template rejects this conversation
        raise bad_request(str(exc)) from exc
    assert isinstance(ids, list)
    logprob = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0) or 0
    if top and not logprob:
        raise bad_request("'top_logprobs' needs 'logprobs': true")
    if not 0 <= top <= 20:
        raise bad_request(f"'top_logprobs' must be in [0, 20], got {top}")
    # No max_tokens: the rest of the context (finalize_sub clips to it).
    return _fan_out("chat", body, cfg, tok, [ids], n, _max_tokens(body, cfg.context_length), logprob, top,
                    stream, usage_opts, tools)
