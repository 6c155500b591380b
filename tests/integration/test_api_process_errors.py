"""The API process for real, as in test_api_process (a fake scheduler process behind each API,
driven over loopback HTTP), whose helpers this file imports; the nodes are the session's pair
(tests/integration/conftest.py), the same that test_api_process drives.

Covered here: bad input gets a 400 and never reaches the scheduler, a failed transfer is a 5xx
naming its room, client disconnects send an abort, duplicate and reused rids, /abort_request,
the prefill role (it answers after the transfer and runs to its end when its client leaves) and,
last, the scheduler's death.
"""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from common.ipc.scheduler_client import client_rid
from common.tokenizer import Tokenizer
from tests.integration.test_api_process import Node, _kill, expected_ids, post, post_once_free, sse_events

pytestmark = pytest.mark.integration


# ---- errors -------------------------------------------------------------------------------------

BAD = [
    ("/generate", {"text": ""}),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}),
    ("/generate", {"input_ids": list(range(3, 2100))}),
    ("/generate", {"text": "a", "stream": "yes"}),
    ("/generate", {"text": "the cache " * 2000}),  # > 16 KiB: parsed in a worker thread, then too long
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}),
    ("/v1/completions", {"model": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_p": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2,
                              "bootstrap_host": ["h", "h"], "bootstrap_room": [1]}),
    # Values msgpack cannot carry used to kill the API's send task: every later request hung.
    ("/generate", {"text": "a", "sampling_params": {"seed": 10**30}}),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 2**64}}),
    ("/v1/completions", {"prompt": "a", "seed": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "seed": 2**64}),
]
# Unpaired surrogates (escaped or raw) cannot reach a tokenizer or the scheduler either.
BAD_RAW = [
    (b'{"text": "a\\ud800"}', "surrogate"),
    (b'{"text": "a", "sampling_params": {"stop": ["\\udc80"]}}', "surrogate"),
    (b'{"text": "a", "rid": "x\\ud800"}', "surrogate"),
    (b'{"text": "a\xed\xa0\x80"}', "not valid JSON"),  # an encoded surrogate is not UTF-8
]


def test_bad_inputs_get_400_and_never_reach_the_scheduler(decode: Node) -> None:
    before = len(decode.received("generate"))
    for path, body in BAD:
        for stream in (False, True):
            r = post(decode, path, {**body, "stream": stream} if "stream" not in body else body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    r = httpx.post(decode.url + "/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    for raw, needle in BAD_RAW:
        r = httpx.post(decode.url + "/generate", content=raw, timeout=10)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (raw, r.text)
    time.sleep(0.3)  # anything wrongly sent would have arrived by now
    assert len(decode.received("generate")) == before
    # and the node still serves (a surrogate pair is fine)
    ok = httpx.post(decode.url + "/generate", content=b'{"text": "\\ud83d\\ude00", "sampling_params": '
                    b'{"max_new_tokens": 2, "seed": 9223372036854775807, "top_k": 2147483647}}', timeout=10)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    assert httpx.get(decode.url + "/health", timeout=5).status_code == 200


def test_failed_transfer_is_a_5xx_naming_the_room(decode: Node) -> None:
    body = {"text": "a", "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1503}
    for stream in (False, True):
        r = post(decode, "/generate", {**body, "stream": stream})
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert "room 1503" in r.json()["error"]["message"]
    r = post(decode, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2,
                                              "bootstrap_host": ["h", "h"], "bootstrap_room": [5, 2503]})
    assert r.status_code == 503 and "room 2503" in r.json()["error"]["message"]


# ---- disconnects, duplicates, aborts ------------------------------------------------------------


def test_client_disconnect_mid_stream_sends_abort(decode: Node) -> None:
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1500}, "stream": True, "rid": "disc-stream"}
    with httpx.stream("POST", decode.url + "/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got  # tokens were flowing
    decode.wait_received("abort", lambda m: client_rid(m["rid"]) == "disc-stream")
    # and while waiting for a non-streamed answer
    with pytest.raises(httpx.ReadTimeout):
        post(decode, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1500}, "rid": "disc-whole"},
             timeout=0.5)
    decode.wait_received("abort", lambda m: client_rid(m["rid"]) == "disc-whole")
    assert httpx.get(decode.url + "/get_load", timeout=5).json()[0]["num_reqs"] == 0


def test_rid_reused_right_after_a_disconnect(decode: Node, alphabet: list[int]) -> None:
    for i in range(5):  # the old request's abort answer races the new request: try a few times
        body = {"text": "a", "sampling_params": {"max_new_tokens": 1500}, "stream": True, "rid": "reuse"}
        with httpx.stream("POST", decode.url + "/generate", json=body, timeout=30) as r:
            assert [line for line, _ in zip(r.iter_lines(), range(6)) if line.startswith("data: ")]
        r = post_once_free(decode, {"input_ids": [7 + i], "sampling_params": {"max_new_tokens": 4}, "rid": "reuse"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == expected_ids(alphabet, [7 + i], 4), i
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert out["meta_info"]["id"] == "reuse" and out["meta_info"]["prompt_tokens"] == 1


def test_duplicate_rid_and_abort_request(decode: Node) -> None:
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1500}, "rid": "dup"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, decode, "/generate", body)
        wire = decode.wait_received("generate", lambda m: client_rid(m["rid"]) == "dup")["rid"]
        second = post(decode, "/generate", body)
        assert second.status_code == 400 and "already in flight" in second.json()["error"]["message"]
        aborted = post(decode, "/abort_request", {"rid": "dup"})
        assert aborted.json() == {"aborted": ["dup"]}
        decode.wait_received("abort", lambda m: m["rid"] == wire)  # the scheduler's name for it
        out = first.result(timeout=10).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 1500
    assert out["meta_info"]["id"] == "dup"
    assert len([m for m in decode.received("generate") if client_rid(m["rid"]) == "dup"]) == 1
    assert post(decode, "/abort_request", {"rid": 5}).status_code == 400


# ---- prefill role -------------------------------------------------------------------------------


def test_prefill_answers_after_the_transfer(prefill: Node) -> None:
    body = {"text": "the cache", "sampling_params": {"max_new_tokens": 8}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": None, "bootstrap_room": 42, "stream": True}
    events = sse_events(post(prefill, "/generate", body))
    assert len(events) == 2
    assert events[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert events[0]["output_ids"] == [] and events[0]["text"] == ""
    whole = post(prefill, "/generate", {**body, "stream": False, "bootstrap_room": 43}).json()
    assert whole["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    chat = post(prefill, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                  "bootstrap_host": "h", "bootstrap_room": 44})
    chunks = sse_events(chat)[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = post(prefill, "/generate", {**body, "bootstrap_room": 3503})
    assert r.status_code == 503 and "room 3503" in r.json()["error"]["message"]
    assert [m["bootstrap_port"] for m in prefill.received("generate") if m["bootstrap_room"] == 42] == [8123]


def test_prefill_runs_to_its_end_when_the_client_leaves(prefill: Node) -> None:
    body = {"text": "a", "bootstrap_host": "h", "bootstrap_room": 45, "rid": "p-leave"}
    with pytest.raises(httpx.ReadTimeout):
        post(prefill, "/generate", body, timeout=0.05)
    time.sleep(0.8)  # the fake prefill finishes after one 0.3 s step
    assert [m for m in prefill.received("generate") if client_rid(m["rid"]) == "p-leave"]
    assert not [m for m in prefill.received("abort") if client_rid(m["rid"]) == "p-leave"]
    assert httpx.get(prefill.url + "/get_load", timeout=5).json()[0]["num_reqs"] == 0



def test_prefill_rid_reused_while_the_left_request_runs(prefill: Node, tok: Tokenizer) -> None:
    """The left request (1 prompt token) finishes after the reuse (3 tokens) was sent: its answer
    used to be routed by rid into the new request."""
    body = {"text": "a", "bootstrap_host": "h", "bootstrap_room": 46, "rid": "p-reuse"}
    with pytest.raises(httpx.ReadTimeout):
        post(prefill, "/generate", body, timeout=0.05)
    prompt = "the cache node"
    r = post_once_free(prefill, {**body, "text": prompt, "bootstrap_room": 47})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["id"] == "p-reuse" and meta["prompt_tokens"] == len(tok.encode(prompt)) != len(tok.encode("a"))
    sent = [m for m in prefill.received("generate") if client_rid(m["rid"]) == "p-reuse"]
    assert [m["bootstrap_room"] for m in sent] == [46, 47] and sent[0]["rid"] != sent[1]["rid"]


# ---- scheduler death ----------------------------------------------------------------------------


def test_scheduler_death_fails_requests_with_503(decode: Node) -> None:
    """Runs last of this file and test_api_process (which sorts first): it kills the decode node's
    scheduler, so the session's decode serves both files first (the fixture starts a fresh one
    for any test after this)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, decode, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1500},
                                                          "rid": "orphan"})
        decode.wait_received("generate", lambda m: client_rid(m["rid"]) == "orphan")
        _kill(decode.fake)
        r = pending.result(timeout=15)
    assert r.status_code == 503 and "scheduler process exited" in r.json()["error"]["message"]
    assert httpx.get(decode.url + "/health", timeout=5).status_code == 503
    assert post(decode, "/generate", {"text": "a"}).status_code == 503
