"""Request validation against the wire: whatever the parsers accept must encode as a GenerateReq
(msgpack ints are at most 64 bits), and what cannot travel is a 400 naming the field — never an
exception inside the API process's send task, which used to stop it and hang every later request.
"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.ipc.protocol import GenerateReq, decode_to_scheduler, encode
from common.request import InvalidRequest, SamplingParams
from common.server.config import ApiConfig
from common.server.errors import ApiError
from common.server.parse_common import ParsedRequest
from common.server.parse_native import parse_generate
from common.server.parse_openai import parse_chat, parse_completion
from common.tokenizer import Tokenizer

CTX = 64
HUGE = [2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def cfg(tiny_qwen3: str) -> ApiConfig:
    return ApiConfig.for_model_dir("decode", tiny_qwen3, context_length=CTX, bootstrap_port=7000)


def wire(req: ParsedRequest) -> list[GenerateReq]:
    """What the API would send, through the real encoder and the scheduler's decoder."""
    out = []
    for s in req.subs:
        msg = GenerateReq(rid=s.rid, input_ids=s.input_ids, sampling=s.sampling, bootstrap_host=s.bootstrap_host,
                          bootstrap_port=s.bootstrap_port, bootstrap_room=s.bootstrap_room)
        back = decode_to_scheduler(encode(msg))
        assert back == msg
        out.append(back)
    return out


def native(sp: dict) -> dict:
    return {"text": "a", "sampling_params": sp}


def chat(extra: dict) -> dict:
    return {"messages": [{"role": "user", "content": "a"}], **extra}


@pytest.mark.parametrize("value", [-1, 2**63, 2**64 - 1, 2**64, 10**30])
def test_seed_outside_int63_is_a_400(cfg: ApiConfig, tok: Tokenizer, value: int) -> None:
    for fn, body in ((parse_generate, native({"seed": value})), (parse_completion, {"prompt": "a", "seed": value}),
                     (parse_chat, chat({"seed": value}))):
        with pytest.raises(ApiError) as ei:
            fn(body, cfg, tok)
        assert ei.value.status == 400 and "seed" in ei.value.message and str(value) in ei.value.message


@pytest.mark.parametrize("value", [2**31, 2**63, 2**64, 10**30])
def test_top_k_above_int31_is_a_400(cfg: ApiConfig, tok: Tokenizer, value: int) -> None:
    for fn, body in ((parse_generate, native({"top_k": value})), (parse_completion, {"prompt": "a", "top_k": value})):
        with pytest.raises(ApiError) as ei:
            fn(body, cfg, tok)
        assert ei.value.status == 400 and "top_k" in ei.value.message


def test_largest_accepted_values_travel(cfg: ApiConfig, tok: Tokenizer) -> None:
    [msg] = wire(parse_generate(native({"seed": 2**63 - 1, "top_k": 2**31 - 1, "max_new_tokens": 10**30}), cfg, tok))
    assert (msg.sampling.seed, msg.sampling.top_k, msg.sampling.max_new_tokens) == (2**63 - 1, 2**31 - 1, CTX - 1)


INTS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from(HUGE + [-(2**63) - 1, -(2**63), 0, 1]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["seed", "top_k", "max_new_tokens", "n", "stop_token_ids", "top_logprobs_num",
                              "bootstrap_room", "bootstrap_port"]),
       value=INTS)
def test_every_accepted_integer_encodes(cfg: ApiConfig, tok: Tokenizer, field: str, value: int) -> None:
    """Independent of the bounds chosen: accepted => encodable, else a 400."""
    body: dict[str, Any] = {"text": "a", "sampling_params": {}}
    if field == "stop_token_ids":
        body["sampling_params"][field] = [value]
    elif field in ("top_logprobs_num",):
        body[field] = value
    elif field in ("bootstrap_room", "bootstrap_port"):
        body.update({"bootstrap_host": "h", "bootstrap_room": 1, field: value})
    else:
        body["sampling_params"][field] = value
    try:
        req = parse_generate(body, cfg, tok)
    except ApiError as exc:
        assert exc.status == 400 and exc.message
        return
    wire(req)


# ---- per-sample seeds ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed,want", [(10, [10, 11, 12]), (2**63 - 2, [2**63 - 2, 2**63 - 1, 0]),
                                       (None, [None, None, None])])
def test_n_samples_get_seed_plus_j_on_every_endpoint(cfg: ApiConfig, tok: Tokenizer, seed: int | None,
                                                    want: list[int | None]) -> None:
    """Native /generate used to give all n samples the same seed, hence n identical answers."""
    native_req = parse_generate({"text": ["a", "b"], "sampling_params": {"n": 3, "seed": seed}}, cfg, tok)
    completion = parse_completion({"prompt": ["a", "b"], "n": 3, "seed": seed}, cfg, tok)
    chat_req = parse_chat(chat({"n": 3, "seed": seed}), cfg, tok)
    for req, prompts in ((native_req, 2), (completion, 2), (chat_req, 1)):
        assert [m.sampling.seed for m in wire(req)] == want * prompts


def test_an_invalid_seed_is_not_wrapped_into_range(cfg: ApiConfig, tok: Tokenizer) -> None:
    for body in (native({"n": 2, "seed": -1}), native({"n": 2, "seed": 2**63})):
        with pytest.raises(ApiError, match="seed"):
            parse_generate(body, cfg, tok)


@pytest.mark.parametrize("penalty", [0.0, -1.0, 1e300, float("inf"), float("nan"), 100.5])
def test_repetition_penalty_out_of_range_is_rejected(penalty: float) -> None:
    with pytest.raises(InvalidRequest, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty).validate()


def test_repetition_penalty_at_the_bound_is_accepted() -> None:
    SamplingParams(repetition_penalty=100.0).validate()
