"""Response shaping of the API process: SubState folding, native/OpenAI bodies, SSE chunks, metrics
text (SchedulerClient: test_server_scheduler_client.py)."""
from __future__ import annotations

import json

import pytest

from common.ipc.protocol import ReqOutput
from common.request import FinishReason, SamplingParams
from common.server import metrics as metrics_mod
from common.server.config import ApiConfig
from common.server.errors import error_body
from common.server.metrics import ApiMetrics, scheduler_gauges
from common.server.outputs import SubState
from common.server.parse_common import ParsedRequest, SubRequest
from common.server.responses import DONE, StreamShaper, chat_body, completion_body, native_body, usage
from common.tokenizer import Tokenizer

WORDS = [" cache", " node", " page", " the", " token"]


@pytest.fixture(scope="module")
def tok(tiny_qwen3: str) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def ids(tok: Tokenizer) -> list[int]:
    out = []
    for w in WORDS:
        [t] = tok.encode(w, add_special_tokens=False)  # single-token words in the tiny vocabulary
        out.append(t)
    return out


def make_req(kind: str, prompts: list[list[int]], n: int = 1, stop: list[str] | None = None, logprob: bool = False,
             top: int = 0, include_usage: bool = False, batch: bool = False) -> ParsedRequest:
    subs = []
    for i, p in enumerate(prompts):
        for j in range(n):
            subs.append(SubRequest(rid=f"r-{i * n + j}", index=i * n + j, input_ids=p,
                                   sampling=SamplingParams(stop=stop or []), return_logprob=logprob,
                                   top_logprobs_num=top))
    return ParsedRequest(kind=kind, rid="req-1", subs=subs, stream=True, model="m", n=n,  # type: ignore[arg-type]
                         include_usage=include_usage, batch=batch, arrival_time=1000.0)


def feed(s: SubState, toks: list[int], finish: FinishReason | None, logprob: bool = False) -> list[str]:
    """One ReqOutput per token; the last one carries ``finish``. Returns the deltas."""
    deltas = []
    for k, t in enumerate(toks):
        last = k == len(toks) - 1
        deltas.append(s.apply(ReqOutput(
            rid=s.sub.rid, new_token_ids=[t], new_logprobs=[-0.1 * (k + 1)] if logprob else None,
            new_top_logprobs=[[(t, -0.1 * (k + 1)), (toks[0], -5.0)]] if logprob else None,
            finish=finish if last else None, prompt_tokens=len(s.sub.input_ids), completion_tokens=k + 1,
            cached_tokens=2)))
    return deltas


# ---- SubState -----------------------------------------------------------------------------------


def test_stop_string_cuts_text_and_never_streams_part_of_it(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("generate", [[1, 2]], stop=[" pa"])
    s = SubState.new(req.subs[0], tok)
    toks = [ids[0], ids[1], ids[2], ids[3]]  # " cache node page the"
    deltas = feed(s, toks, FinishReason(type="length", length=4))
    full = tok.decode(toks)
    assert s.text == full[: full.index(" pa")] == " cache node"
    assert "".join(deltas) == s.text
    assert all(" pa" not in d and not d.endswith(" p") for d in deltas)
    assert s.output_ids == toks  # ids are reported raw; only the text is cut


def test_matched_stop_token_is_left_out_of_text(tok: Tokenizer, ids: list[int]) -> None:
    s = SubState.new(make_req("generate", [[1]]).subs[0], tok)
    feed(s, [ids[0], ids[1], ids[2]], FinishReason(type="stop", matched=ids[2]))
    assert s.text == tok.decode([ids[0], ids[1]]) and s.finish is not None and s.finish.type == "stop"


def test_failure_is_recorded(tok: Tokenizer) -> None:
    s = SubState.new(make_req("generate", [[1]]).subs[0], tok)
    s.apply(ReqOutput(rid="r-0", finish=FinishReason(type="abort", message="room 5 failed"), error="room 5 failed",
                      http_status=503))
    assert s.failed and s.finished and s.http_status == 503 and s.text == ""
    # an abort without an error (client abort) is a normal finish, not a failure
    s2 = SubState.new(make_req("generate", [[1]]).subs[0], tok)
    s2.apply(ReqOutput(rid="r-0", finish=FinishReason(type="abort", message="aborted")))
    assert s2.finished and not s2.failed


# ---- whole bodies -------------------------------------------------------------------------------


def test_native_body_shapes(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("generate", [[1, 2, 3]], logprob=True, top=2)
    s = SubState.new(req.subs[0], tok)
    feed(s, ids[:2], FinishReason(type="length", length=2), logprob=True)
    body = native_body(req, [s], tok)
    assert body["text"] == tok.decode(ids[:2]) and body["output_ids"] == ids[:2]
    meta = body["meta_info"]
    assert meta["id"] == "r-0" and meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 2, 2)
    assert meta["output_token_logprobs"] == [[-0.1, ids[0], None], [-0.2, ids[1], None]]
    assert meta["output_top_logprobs"][1] == [[-0.2, ids[1], None], [-5.0, ids[0], None]]
    req.batch = True
    assert isinstance(native_body(req, [s], tok), list)


def test_completion_body_usage_counts_each_prompt_once(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("completion", [[1, 2, 3], [4, 5]], n=2)
    states = [SubState.new(sub, tok) for sub in req.subs]
    for k, s in enumerate(states):
        feed(s, ids[: k + 1], FinishReason(type="length", length=k + 1))
    body = completion_body(req, states, tok)
    assert body["object"] == "text_completion" and body["id"] == "req-1" and body["model"] == "m"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [tok.decode(ids[: k + 1]) for k in range(4)]
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_decodes_reuse_is_reported_beside_the_prefills_hit(tok: Tokenizer, ids: list[int]) -> None:
    """A decode's answer to a disaggregated request carries its own prefix-cache hit
    (``decode_reused_tokens``) in meta_info and in usage.prompt_tokens_details, counted once per
    prompt like cached_tokens; any other answer (a prefill's, a local request's) has no such key."""
    req = make_req("completion", [[1, 2, 3], [4, 5]], n=2)
    states = [SubState.new(sub, tok) for sub in req.subs]
    for k, s in enumerate(states):
        s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=[ids[0]], prompt_tokens=len(s.sub.input_ids),
                          completion_tokens=1, cached_tokens=2, decode_reused_tokens=16 * (k + 1)))
        s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=[ids[1]], finish=FinishReason(type="length", length=2),
                          prompt_tokens=len(s.sub.input_ids), completion_tokens=2, cached_tokens=2,
                          decode_reused_tokens=16 * (k + 1)))
    # samples 0 and 2 are each prompt's first: 16 + 48
    assert usage(req, states)["prompt_tokens_details"] == {"cached_tokens": 4, "decode_reused_tokens": 64}
    native = make_req("generate", [[1, 2, 3]])
    assert native_body(native, [states[1]], tok)["meta_info"]["decode_reused_tokens"] == 32
    plain = SubState.new(native.subs[0], tok)
    feed(plain, ids[:2], FinishReason(type="length", length=2))  # no decode_reused_tokens in its outputs
    assert "decode_reused_tokens" not in native_body(native, [plain], tok)["meta_info"]
    assert usage(native, [plain])["prompt_tokens_details"] == {"cached_tokens": 2}


def test_chat_body_with_logprobs(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("chat", [[1, 2]], logprob=True, top=2)
    s = SubState.new(req.subs[0], tok)
    feed(s, ids[:2], FinishReason(type="stop", matched=ids[1]), logprob=True)
    body = chat_body(req, [s], tok)
    [choice] = body["choices"]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": WORDS[0]}
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == ids[1]
    first = choice["logprobs"]["content"][0]
    assert first["token"] == WORDS[0] and first["logprob"] == pytest.approx(-0.1)
    assert first["bytes"] == list(WORDS[0].encode())
    assert [t["token"] for t in first["top_logprobs"]] == [WORDS[0], WORDS[0]]


# ---- streams ------------------------------------------------------------------------------------


def parse_sse(chunks: list[bytes]) -> list[dict]:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        out.append(json.loads(c[6:-2]))
    return out


def test_chat_stream_role_first_deltas_sum_to_text_then_usage(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("chat", [[1, 2]], n=2, include_usage=True)
    states = [SubState.new(sub, tok) for sub in req.subs]
    shaper = StreamShaper(req, tok)
    chunks: list[bytes] = []
    toks = [ids[0], ids[1], ids[2]]
    for k, t in enumerate(toks):
        for s in states:
            fin = FinishReason(type="length", length=3) if k == 2 else None
            delta = s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=[t], finish=fin, prompt_tokens=2,
                                      completion_tokens=k + 1))
            chunks += shaper.update(s, delta)
    tail = shaper.usage_chunk(states)
    assert tail is not None
    objs = parse_sse(chunks + [tail])
    for idx in (0, 1):
        mine = [o["choices"][0] for o in objs if o["choices"] and o["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == tok.decode(toks)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 6
    assert objs[-1]["usage"]["prompt_tokens"] == 2
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == "req-1" for o in objs)


def test_continuous_usage_gives_every_token_a_chunk_with_its_count(tok: Tokenizer, ids: list[int]) -> None:
    """stream_options.continuous_usage_stats: a token whose text is held back (here: it may be
    the start of a stop string) still gets its chunk, and each chunk says how many tokens the
    choice has so far; without the option the held-back token sends nothing."""
    toks = [ids[0], ids[1], ids[2]]  # " cache node page": " node" may begin the stop " nodeX"
    seen = {}
    for continuous in (False, True):
        req = make_req("completion", [[1, 2]], stop=[" nodeX"])
        req.continuous_usage = continuous
        s = SubState.new(req.subs[0], tok)
        shaper = StreamShaper(req, tok)
        chunks: list[bytes] = []
        for k, t in enumerate(toks):
            fin = FinishReason(type="length", length=3) if k == 2 else None
            delta = s.apply(ReqOutput(rid=s.sub.rid, new_token_ids=[t], finish=fin, prompt_tokens=2,
                                      completion_tokens=k + 1, cached_tokens=1, decode_reused_tokens=0))
            chunks += shaper.update(s, delta)
        seen[continuous] = parse_sse(chunks)
    plain, counted = seen[False], seen[True]
    assert len(plain) == 2 and all("usage" not in o for o in plain)
    assert [o["choices"][0]["text"] for o in counted] == [" cache", "", " node page"]
    assert [o["usage"]["completion_tokens"] for o in counted] == [1, 2, 3]
    assert counted[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                    "prompt_tokens_details": {"cached_tokens": 1, "decode_reused_tokens": 0}}
    assert "".join(o["choices"][0]["text"] for o in counted) == tok.decode(toks)


def test_native_stream_is_cumulative_and_skips_empty_updates(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("generate", [[1]])
    s = SubState.new(req.subs[0], tok)
    shaper = StreamShaper(req, tok)
    assert shaper.update(s, s.apply(ReqOutput(rid="r-0", prompt_tokens=1))) == []  # nothing new
    got = []
    for k, t in enumerate(ids[:3]):
        fin = FinishReason(type="length", length=3) if k == 2 else None
        got += parse_sse(shaper.update(s, s.apply(ReqOutput(rid="r-0", new_token_ids=[t], finish=fin))))
    assert [g["text"] for g in got] == [tok.decode(ids[:k]) for k in (1, 2, 3)]
    assert [g["output_ids"] for g in got] == [ids[:k] for k in (1, 2, 3)]
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert shaper.usage_chunk([s]) is None and DONE == b"data: [DONE]\n\n"


def test_completion_stream_logprob_offsets(tok: Tokenizer, ids: list[int]) -> None:
    req = make_req("completion", [[1]], logprob=True, top=1)
    s = SubState.new(req.subs[0], tok)
    shaper = StreamShaper(req, tok)
    chunks = []
    for k, t in enumerate(ids[:3]):
        fin = FinishReason(type="length", length=3) if k == 2 else None
        delta = s.apply(ReqOutput(rid="r-0", new_token_ids=[t], new_logprobs=[-1.0], new_top_logprobs=[[(t, -1.0)]],
                                  finish=fin))
        chunks += shaper.update(s, delta)
    objs = parse_sse(chunks)
    offsets = [off for o in objs for off in o["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, len(WORDS[0]), len(WORDS[0]) + len(WORDS[1])]
    assert "".join(o["choices"][0]["text"] for o in objs) == tok.decode(ids[:3])


def test_usage_and_error_shapes() -> None:
    assert error_body(503, "room 9 failed") == {"error": {"message": "room 9 failed",
                                                          "type": "ServiceUnavailableError", "code": 503}}
    assert usage(make_req("chat", [[1]]), [])["total_tokens"] == 0


# ---- metrics ------------------------------------------------------------------------------------


def test_scheduler_gauges_skip_non_numbers() -> None:
    text = scheduler_gauges({"num_running_reqs": 3, "token usage": 0.5, "flag": True, "name": "x",
                             "bad": float("nan")}, {"role": "decode"})
    assert 'pdc_scheduler_up{role="decode"} 1' in text
    assert 'pdc_scheduler_num_running_reqs{role="decode"} 3.0' in text
    assert 'pdc_scheduler_token_usage{role="decode"} 0.5' in text
    for name in ("flag", "name", "bad"):
        assert f"pdc_scheduler_{name}" not in text
    assert 'pdc_scheduler_up{role="decode"} 0' in scheduler_gauges(None, {"role": "decode"})


def test_api_metrics_render(tiny_qwen3: str) -> None:
    m = ApiMetrics("prefill", "tiny", window_s=10.0)
    m.on_tokens(25)
    text = m.render({"num_waiting_reqs": 2}).decode()
    assert 'pdc_api_generation_tokens_total{model_name="tiny",role="prefill"} 25.0' in text
    assert 'pdc_api_generation_tokens_per_second{model_name="tiny",role="prefill"} 2.5' in text
    assert 'pdc_scheduler_num_waiting_reqs{model_name="tiny",role="prefill"} 2.0' in text
    ApiConfig.for_model_dir("prefill", tiny_qwen3).validate()


def test_throughput_window_stays_bounded_without_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: clock[0])
    m = ApiMetrics("decode", "tiny", window_s=10.0)
    for _ in range(5000):  # 625 s of output, 8 outputs/s (0.125 s is exact in binary), never scraped
        m.on_tokens(2)
        clock[0] += 0.125
    assert len(m._recent) <= 11  # one entry per second, only the last window's
    clock[0] -= 0.125  # render at the last output (t = 724.875): seconds 715 .. 724 count, 16 tokens each
    text = m.render(None).decode()
    assert 'pdc_api_generation_tokens_per_second{model_name="tiny",role="decode"} 16.0' in text
    assert 'pdc_api_generation_tokens_total{model_name="tiny",role="decode"} 10000.0' in text

