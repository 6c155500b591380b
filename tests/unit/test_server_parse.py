"""Request parsing and validation of the API process (no server, no scheduler)."""
from __future__ import annotations

from typing import Any

import pytest

from common.server.config import ApiConfig
from common.server.errors import ApiError
from common.server.parse_native import parse_generate
from common.server.parse_openai import parse_chat, parse_completion
from common.tokenizer import Tokenizer

CTX = 64


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def cfg(tiny_qwen3: str) -> ApiConfig:
    return ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=CTX, bootstrap_port=7000)


def bad(fn: Any, body: Any, cfg: ApiConfig, tok: Tokenizer, *needles: str) -> str:
    with pytest.raises(ApiError) as ei:
        fn(body, cfg, tok)
    assert ei.value.status == 400
    for n in needles:
        assert n in ei.value.message, ei.value.message
    return ei.value.message


# ---- /generate ----------------------------------------------------------------------------------


def test_generate_single_text(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_generate({"text": "the cache node", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                         "stop": "x", "extra_unknown": 1},
                          "rid": "my-rid", "stream": True, "unknown_field": {"a": 1}}, cfg, tok)
    assert req.kind == "generate" and req.stream and not req.batch and req.rid == "my-rid"
    [sub] = req.subs
    assert sub.rid == "my-rid" and sub.index == 0
    assert sub.input_ids == tok.encode("the cache node")
    assert sub.sampling.max_new_tokens == 5 and sub.sampling.temperature == 0.0 and sub.sampling.stop == ["x"]
    assert sub.bootstrap_room is None and sub.bootstrap_host is None and sub.bootstrap_port is None


def test_generate_min_new_tokens_reaches_sampling(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_generate({"text": "a", "sampling_params": {"max_new_tokens": 5, "min_new_tokens": 2}}, cfg, tok)
    assert req.subs[0].sampling.min_new_tokens == 2


def test_generate_batch_with_n_fans_out_item_major(cfg: ApiConfig, tok: Tokenizer) -> None:
    rooms = [11, 12, 13, 14]
    req = parse_generate({"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"n": 2, "max_new_tokens": 3},
                          "bootstrap_host": ["h"] * 4, "bootstrap_port": [None, 9000, None, 9001],
                          "bootstrap_room": rooms, "rid": "b"}, cfg, tok)
    assert req.batch and req.n == 2
    assert [s.input_ids for s in req.subs] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    assert [s.index for s in req.subs] == [0, 1, 2, 3]
    assert [s.rid for s in req.subs] == ["b-0", "b-1", "b-2", "b-3"]
    assert [s.bootstrap_room for s in req.subs] == rooms
    # null port -> the node's default bootstrap port
    assert [s.bootstrap_port for s in req.subs] == [7000, 9000, 7000, 9001]
    assert all(s.sampling.n == 1 for s in req.subs)
    assert req.subs[0].sampling is not req.subs[1].sampling


def test_generate_rid_list_and_per_item_logprob(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_generate({"text": ["a", "b"], "rid": ["x", "y"], "return_logprob": [True, False],
                          "top_logprobs_num": [2, 0]}, cfg, tok)
    assert [s.rid for s in req.subs] == ["x", "y"]
    assert [(s.return_logprob, s.top_logprobs_num) for s in req.subs] == [(True, 2), (False, 0)]
    assert req.subs[0].sampling.return_logprob and req.subs[0].sampling.top_logprobs_num == 2


def test_generate_room_range_is_int64(cfg: ApiConfig, tok: Tokenizer) -> None:
    # Rooms are minted in [0, 2^63-1] and the aux row stores them as int64: a larger room would
    # fail the transfer only after all the prefill work, so it is a 400 up front.
    req = parse_generate({"text": "a", "bootstrap_host": "p", "bootstrap_port": None,
                          "bootstrap_room": 2**63 - 1}, cfg, tok)
    assert req.subs[0].bootstrap_room == 2**63 - 1 and req.subs[0].bootstrap_port == 7000
    for room in (2**63, 2**64 - 1, 2**64, -1):
        bad(parse_generate, {"text": "a", "bootstrap_host": "p", "bootstrap_room": room}, cfg, tok,
            "'bootstrap_room'", "[0, 2^63-1]")
        bad(parse_chat, {"messages": [{"role": "user", "content": "a"}], "n": 2, "bootstrap_host": ["p", "p"],
                         "bootstrap_room": [5, room]}, cfg, tok, "'bootstrap_room'", str(room))


def test_one_room_for_several_sequences_becomes_consecutive_rooms(cfg: ApiConfig, tok: Tokenizer) -> None:
    # sglang-router 0.3.2 sends one scalar room for n > 1 on /generate and /v1/completions; SGLang
    # gives sequence i room + i, and so must we (a room pairs one sequence on each side).
    req = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"n": 3}, "bootstrap_host": "p",
                          "bootstrap_port": None, "bootstrap_room": 40}, cfg, tok)
    assert [s.bootstrap_room for s in req.subs] == [40, 41, 42]
    assert [(s.bootstrap_host, s.bootstrap_port) for s in req.subs] == [("p", 7000)] * 3
    req = parse_completion({"model": "x", "prompt": "a", "n": 2, "bootstrap_host": "p", "bootstrap_port": 9000,
                            "bootstrap_room": 2**63 - 1}, cfg, tok)
    assert [s.bootstrap_room for s in req.subs] == [2**63 - 1, 0]  # wrapped: the aux row stores int64
    req = parse_generate({"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_room": 5}, cfg, tok)
    assert [s.bootstrap_room for s in req.subs] == [5, 6]
    bad(parse_generate, {"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_room": 2**63}, cfg, tok,
        "'bootstrap_room'", "[0, 2^63-1]")
    bad(parse_generate, {"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_room": True}, cfg, tok,
        "'bootstrap_room'")


@pytest.mark.parametrize("body,needles", [
    ({"text": "a", "input_ids": [1]}, ["either"]),
    ({}, ["'text' or 'input_ids'"]),
    ({"text": ""}, ["prompt is empty"]),
    ({"input_ids": []}, ["prompt is empty"]),
    ({"text": 5}, ["'text'"]),
    ({"text": []}, ["'text'"]),
    ({"input_ids": [1, "2"]}, ["input_ids"]),
    ({"input_ids": [[1], [2, "x"]]}, ["input_ids"]),
    ({"input_ids": [1, 10**6]}, ["outside the vocabulary"]),
    ({"input_ids": [1, -1]}, ["outside the vocabulary"]),
    ({"input_ids": list(range(1, CTX + 1))}, [f"{CTX} tokens", "context length"]),
    ({"text": "a", "sampling_params": {"temperature": -1}}, ["temperature"]),
    ({"text": "a", "sampling_params": {"top_p": 0}}, ["top_p"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": "ten"}}, ["max_new_tokens"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, ["max_new_tokens"]),
    ({"text": "a", "sampling_params": {"stop": [1]}}, ["stop"]),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10**6]}}, ["stop_token_ids"]),
    ({"text": "a", "sampling_params": {"regex": "(a+"}}, ["invalid regex", "unclosed group"]),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, ["structural_tag", "not supported"]),
    ({"text": "a", "sampling_params": [{}, {}]}, ["2 entries for 1 sequences"]),
    ({"text": "a", "sampling_params": "x"}, ["sampling_params"]),
    ({"text": "a", "stream": "yes"}, ["stream", "boolean"]),
    ({"text": "a", "return_logprob": 1}, ["return_logprob"]),
    ({"text": "a", "top_logprobs_num": 50}, ["top_logprobs_num"]),
    ({"text": "a", "rid": 5}, ["rid"]),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, ["distinct"]),
    ({"text": ["a", "b"], "bootstrap_host": ["h"], "bootstrap_room": [1]}, ["1 entries for 2 sequences"]),
    ({"text": ["a", "b"], "bootstrap_host": ["h", "h"], "bootstrap_room": [1, 1]}, ["distinct"]),
    ({"text": "a", "bootstrap_room": 5}, ["together"]),
    ({"text": "a", "bootstrap_host": "h", "bootstrap_room": -5}, ["bootstrap_room"]),
    ({"text": "a", "bootstrap_host": "h", "bootstrap_room": 1, "bootstrap_port": 70000}, ["bootstrap_port"]),
    ({"text": "a", "image_data": "x.png"}, ["image_data", "not supported"]),
    ([{"text": "a"}], ["JSON object"]),
])
def test_generate_rejects(cfg: ApiConfig, tok: Tokenizer, body: Any, needles: list[str]) -> None:
    bad(parse_generate, body, cfg, tok, *needles)


def test_max_new_tokens_clipped_to_context(cfg: ApiConfig, tok: Tokenizer) -> None:
    ids = list(range(1, 61))  # 60 of 64
    req = parse_generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 100}}, cfg, tok)
    assert req.subs[0].sampling.max_new_tokens == CTX - 60
    req = parse_generate({"input_ids": ids[:10]}, cfg, tok)  # default 128 also clipped
    assert req.subs[0].sampling.max_new_tokens == CTX - 10
    req = parse_generate({"input_ids": ids[:10], "sampling_params": {"max_new_tokens": 3}}, cfg, tok)
    assert req.subs[0].sampling.max_new_tokens == 3
    # the longest prompt allowed leaves room for one token
    req = parse_generate({"input_ids": list(range(1, CTX))}, cfg, tok)
    assert req.subs[0].sampling.max_new_tokens == 1


def test_batch_size_limit(tiny_qwen3: str, tok: Tokenizer) -> None:
    cfg = ApiConfig.for_model_dir("decode", tiny_qwen3, max_batch_size=3)
    bad(parse_generate, {"text": ["a", "b"], "sampling_params": {"n": 2}}, cfg, tok, "4 sequences", "limit is 3")


# ---- /v1/completions ----------------------------------------------------------------------------

# What sglang-router 0.3.2 forwards after rebuilding the body from its typed schema.
ROUTER_COMPLETION = {
    "model": None, "prompt": "the cache", "max_completion_tokens": 6, "temperature": 0.0, "stream": False,
    "n": 1, "logprobs": None, "echo": False, "stop": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "best_of": None, "logit_bias": None, "user": None, "seed": None, "suffix": None, "top_k": None,
    "min_p": None, "min_tokens": None, "repetition_penalty": None, "regex": None, "json_schema": None,
    "ebnf": None, "stop_token_ids": None, "no_stop_trim": False, "ignore_eos": False,
    "skip_special_tokens": True, "lora_path": None, "session_params": None, "return_hidden_states": False,
    "other": {"x": 1},
}


def test_completion_router_body(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_completion(ROUTER_COMPLETION, cfg, tok)
    [sub] = req.subs
    assert req.kind == "completion" and req.rid.startswith("cmpl-") and req.model == cfg.model_name
    assert sub.input_ids == tok.encode("the cache")
    assert sub.sampling.max_new_tokens == 6 and sub.sampling.temperature == 0.0 and not sub.return_logprob


def test_completion_extras_map_to_sampling(cfg: ApiConfig, tok: Tokenizer) -> None:
    body = {"model": "unknown", "prompt": [[5, 6], [7]], "max_tokens": 4, "n": 2, "seed": 10, "top_k": 5,
            "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [3], "ignore_eos": True, "logprobs": 2,
            "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}}
    req = parse_completion(body, cfg, tok)
    assert req.stream and req.include_usage and req.n == 2 and not req.continuous_usage
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    again = parse_completion(body, cfg, tok)
    assert again.continuous_usage and not again.include_usage
    assert [s.input_ids for s in req.subs] == [[5, 6], [5, 6], [7], [7]]
    s = req.subs[0].sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.stop_token_ids, s.ignore_eos, s.stop) == \
        (5, 0.1, 1.2, [3], True, ["\n"])
    # seed + j: the n samples of one prompt differ but stay reproducible
    assert [x.sampling.seed for x in req.subs] == [10, 11, 10, 11]
    assert all(x.return_logprob and x.top_logprobs_num == 2 for x in req.subs)
    assert all(x.sampling.max_new_tokens == 4 for x in req.subs)


def test_completion_logit_bias_string_keys_become_token_ids(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_completion({"prompt": "a", "n": 2, "logit_bias": {"5": 1, "7": -100.0}}, cfg, tok)
    assert [s.sampling.logit_bias for s in req.subs] == [{5: 1.0, 7: -100.0}] * 2


def test_min_tokens_maps_to_min_new_tokens(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_completion({"prompt": "a", "max_tokens": 8, "min_tokens": 3}, cfg, tok)
    assert req.subs[0].sampling.min_new_tokens == 3
    bad(parse_completion, {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, cfg, tok, "min_new_tokens")


def test_completion_default_max_tokens_is_16(cfg: ApiConfig, tok: Tokenizer) -> None:
    assert parse_completion({"prompt": "a"}, cfg, tok).subs[0].sampling.max_new_tokens == 16


@pytest.mark.parametrize("body,needles", [
    ({"prompt": ""}, ["prompt is empty"]),
    ({"prompt": []}, ["'prompt'"]),
    ({"prompt": None}, ["'prompt'"]),
    ({"prompt": [["a"]]}, ["'prompt' entries"]),
    ({"prompt": "a", "max_tokens": -2}, ["max_tokens"]),
    ({"prompt": "a", "max_tokens": "5"}, ["max_tokens", "integer"]),
    ({"prompt": "a", "n": 0}, ["'n'"]),
    ({"prompt": "a", "temperature": "hot"}, ["temperature"]),
    ({"prompt": "a", "logprobs": 30}, ["logprobs"]),
    ({"prompt": "a", "echo": True}, ["echo", "not supported"]),
    ({"prompt": "a", "logit_bias": {"x": 1}}, ["logit_bias", "not a token id"]),
    ({"prompt": "a", "logit_bias": {"5": "1"}}, ["logit_bias", "number"]),
    ({"prompt": "a", "logit_bias": {"5": 101}}, ["logit_bias", "[-100, 100]"]),
    ({"prompt": "a", "logit_bias": {"99999999": 1}}, ["logit_bias", "outside vocabulary"]),
    ({"prompt": "a", "logit_bias": [1]}, ["logit_bias", "object"]),
    ({"prompt": "a", "best_of": 3}, ["best_of"]),
    ({"prompt": "a", "stream_options": 3}, ["stream_options"]),
    ({"prompt": "a", "response_format": {"type": "xml"}}, ["response_format.type"]),
])
def test_completion_rejects(cfg: ApiConfig, tok: Tokenizer, body: Any, needles: list[str]) -> None:
    bad(parse_completion, body, cfg, tok, *needles)


# ---- /v1/chat/completions -----------------------------------------------------------------------

ROUTER_CHAT = {
    "model": "unknown", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "temperature": None, "top_p": None, "n": 3, "stream": True, "stream_options": None, "stop": None,
    "max_completion_tokens": 5, "logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": None,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    "bootstrap_host": ["10.1.1.1"] * 3, "bootstrap_port": [None] * 3, "bootstrap_room": [7, 8, 9],
}


def test_chat_router_body_n3(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_chat(ROUTER_CHAT, cfg, tok)
    expected_ids = tok.apply_chat_template(ROUTER_CHAT["messages"], add_generation_prompt=True)
    assert req.kind == "chat" and req.stream and req.n == 3 and req.rid.startswith("chatcmpl-")
    assert [s.input_ids for s in req.subs] == [expected_ids] * 3
    assert [s.bootstrap_room for s in req.subs] == [7, 8, 9]
    assert [s.bootstrap_port for s in req.subs] == [7000] * 3
    assert [s.index for s in req.subs] == [0, 1, 2]
    assert all(s.sampling.max_new_tokens == 5 for s in req.subs)


def test_chat_default_max_tokens_is_rest_of_context(cfg: ApiConfig, tok: Tokenizer) -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, cfg, tok)
    assert req.subs[0].sampling.max_new_tokens == CTX - len(req.subs[0].input_ids)


def test_chat_text_parts_and_logprobs(cfg: ApiConfig, tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "cache"}]}]
    req = parse_chat({"messages": msgs, "logprobs": True, "top_logprobs": 3}, cfg, tok)
    flat = [{"role": "user", "content": "the\ncache"}]  # the tokenizer joins parts with newlines
    assert req.subs[0].input_ids == tok.apply_chat_template(flat, add_generation_prompt=True)
    assert req.subs[0].return_logprob and req.subs[0].top_logprobs_num == 3


@pytest.mark.parametrize("body,needles", [
    ({"messages": []}, ["'messages'"]),
    ({"messages": "hi"}, ["'messages'"]),
    ({"messages": ["hi"]}, ["messages[0]"]),
    ({"messages": [{"content": "hi"}]}, ["messages[0].role"]),
    ({"messages": [{"role": "user", "content": 5}]}, ["messages[0].content"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["text content parts"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, ["needs 'logprobs'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, ["top_logprobs"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, ["tools"]),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2, "bootstrap_host": ["h"] * 3,
      "bootstrap_room": [1, 2, 3]}, ["3 entries for 2 sequences"]),
    ({"messages": [{"role": "user", "content": "word " * 80}]}, ["context length"]),
])
def test_chat_rejects(cfg: ApiConfig, tok: Tokenizer, body: Any, needles: list[str]) -> None:
    bad(parse_chat, body, cfg, tok, *needles)


def test_api_config_from_node_config(tiny_qwen3: str) -> None:
    from common.config import ModelConfig, NodeConfig, ServerConfig, TransferConfig

    node = NodeConfig(role="prefill", model=ModelConfig(model_path=tiny_qwen3, served_model_name="tiny"),
                      server=ServerConfig(port=31000), transfer=TransferConfig(bootstrap_port=9100))
    api = ApiConfig.from_node_config(node)
    assert (api.role, api.model_name, api.port, api.bootstrap_port) == ("prefill", "tiny", 31000, 9100)
    assert api.context_length == 2048 and api.model_type == "qwen3"  # from config.json
    assert api.architectures == ("Qwen3ForCausalLM",) and api.server_info_extra["page_size"] == 16
    node = NodeConfig(role="decode", model=ModelConfig(model_path=tiny_qwen3, context_length=512))
    assert ApiConfig.from_node_config(node).context_length == 512


def test_node_tls_flags_reach_the_api_config(tiny_qwen3: str, tmp_path: Any) -> None:
    """--ssl-certfile/--ssl-keyfile/--ssl-ca-certs go from the node's flags to uvicorn's config;
    a key or CA without a certificate, or a file that is not there, is a ConfigError."""
    from common.config import ConfigError, ModelConfig, NodeConfig, ServerConfig
    from common.node.launch import server_config

    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("x")
    ns = type("NS", (), dict(host="127.0.0.1", port=31000, max_payload_size=None, header_timeout_s=20.0,
                             body_timeout_s=60.0, max_n=8, ssl_certfile=str(cert), ssl_keyfile=str(key),
                             ssl_ca_certs=str(ca)))()
    server = server_config(ns)  # type: ignore[arg-type]
    server.validate()
    api = ApiConfig.from_node_config(NodeConfig(role="decode", model=ModelConfig(model_path=tiny_qwen3), server=server))
    assert (api.ssl_certfile, api.ssl_keyfile, api.ssl_ca_certs) == (str(cert), str(key), str(ca))
    with pytest.raises(ConfigError, match="need --ssl-certfile"):
        ServerConfig(ssl_ca_certs=str(ca)).validate()
    with pytest.raises(ConfigError, match="no such file"):
        ServerConfig(ssl_certfile=str(tmp_path / "missing.pem")).validate()
