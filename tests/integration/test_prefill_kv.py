"""A running prefill node writes the right KV into a decode's pages (real Mooncake over TCP).

This test plays the router and the decode: it POSTs prompts to ``python -m prefill_node`` with
a bootstrap room while a ``DecodeKVManager`` with registered torch buffers reserves pages for
that room. What lands in those pages must equal the keys/values HF ``transformers`` computes
for the same prompt (its KV cache, float32), and the aux first token must be HF's greedy
first token — for page sizes 1 and 16, with chunked prefill, and for a prompt whose prefix the
node serves from its radix cache.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from _decode_peer import DecodePeer, PrefillNodeProc
from common.kvcache.pool import KVLayout
from tests.reference import hf_model
from transfer import KVPoll

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.integration

CHUNK = 8  # --chunked-prefill-size: every prompt over 8 tokens is computed in several forwards


def hf_kv(model_dir: str, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HF's per-layer (K, V) for ``ids``. Each [T, kv_heads, head_dim] float32."""
    with torch.inference_mode():
        out = hf_model(model_dir)(input_ids=torch.tensor([ids]), use_cache=True)
    layers = out.cache.layers
    return [(lay.keys[0].transpose(0, 1).float(), lay.values[0].transpose(0, 1).float()) for lay in layers]


def hf_first_token(model_dir: str, ids: list[int]) -> int:
    with torch.inference_mode():
        logits = hf_model(model_dir)(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]  # [vocab]
    return int(torch.argmax(logits))


def layout_of(model_dir: str, page_size: int) -> KVLayout:
    cfg = hf_model(model_dir).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, page_size, "float32")


@pytest.fixture(scope="module", params=[("qwen3", 16), ("llama", 1)], ids=["qwen3-page16", "llama-page1"])
def setup(request: pytest.FixtureRequest, tiny_model_factory, tmp_path_factory) -> Iterator[tuple[str, int, PrefillNodeProc, DecodePeer]]:
    arch, page_size = request.param
    model_dir = tiny_model_factory(arch)
    log = str(tmp_path_factory.mktemp("prefill-log") / "node.log")
    node = PrefillNodeProc(model_dir, "--disaggregation-transfer-backend", "mooncake", "--page-size", str(page_size),
                           "--chunked-prefill-size", str(CHUNK), "--max-prefill-tokens", "64",
                           "--max-total-tokens", "4096", "--max-running-requests", "16", log_path=log,
                           env={"PDC_LOG_LEVEL": "INFO"})
    peer = None
    try:
        node.wait_ready()
        peer = DecodePeer(layout_of(model_dir, page_size))
        yield model_dir, page_size, node, peer
    finally:
        if peer is not None:
            peer.close()
        node.stop()


def prompt(model_dir: str, n: int, seed: int) -> list[int]:
    vocab = hf_model(model_dir).config.vocab_size
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_kv_pages_equal_hf_kv_cache(setup) -> None:
    model_dir, page_size, node, peer = setup
    for n, seed in [(5, 1), (CHUNK, 2), (23, 3), (47, 4)]:  # one forward ... six chunks
        ids = prompt(model_dir, n, seed)
        room, resp = peer.generate(node, ids)
        assert resp.status_code == 200, resp.text
        assert room.state is KVPoll.Success, room.reason
        meta = resp.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["prompt_tokens"] == n
        got, want = peer.kv(room), hf_kv(model_dir, ids)
        assert len(got) == len(want)
        for layer, ((k, v), (hk, hv)) in enumerate(zip(got, want)):
            torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-4, msg=lambda m: f"K layer {layer}, {n} tokens: {m}")
            torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-4, msg=lambda m: f"V layer {layer}, {n} tokens: {m}")
        aux = peer.aux_record(room)
        assert aux.room == room.room
        assert aux.token_id == hf_first_token(model_dir, ids)
        assert aux.cached_tokens == meta["cached_tokens"]
        peer.release(room)


def test_chunks_computed_before_the_decode_answers_land_equal_to_hf(setup) -> None:
    """The prefill computes all six chunks of a prompt while no decode has answered for its room
    (--compute-ahead-fraction, on by default) and parks it; only then does this side open the
    room. Everything computed goes out at once and lands equal to HF's KV."""
    import json
    import threading

    import httpx

    model_dir, page_size, node, peer = setup
    ids = prompt(model_dir, 47, seed=21)
    room_id = peer.new_room()
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
               "bootstrap_host": "127.0.0.1", "bootstrap_port": node.bootstrap_port, "bootstrap_room": room_id}
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: result.__setitem__(
        "r", httpx.post(f"{node.url}/generate", content=json.dumps(payload), timeout=30)), daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while node.get("/debug/memory")["parked_reqs"] != 1:
        assert time.monotonic() < deadline and t.is_alive(), node.get("/debug/memory")
        time.sleep(0.01)
    room = peer.open(room_id, f"127.0.0.1:{node.bootstrap_port}", len(ids))
    assert peer.finish(room) is KVPoll.Success, room.reason
    t.join(30)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["meta_info"]["timeline"]["stages_ms"]["bootstrap"] > 0, "it waited parked"
    for (k, v), (hk, hv) in zip(peer.kv(room), hf_kv(model_dir, ids)):
        torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-4)
    assert peer.aux_record(room).token_id == hf_first_token(model_dir, ids)
    peer.release(room)


def test_prefix_cache_hit_still_sends_the_whole_prompt_kv(setup) -> None:
    model_dir, page_size, node, peer = setup
    shared = prompt(model_dir, 40, seed=11)
    first = shared + prompt(model_dir, 3, seed=12)
    room, resp = peer.generate(node, first)
    assert resp.status_code == 200 and room.state is KVPoll.Success
    peer.release(room)
    second = shared + prompt(model_dir, 9, seed=13)
    room, resp = peer.generate(node, second, return_logprob=True, top_logprobs_num=3)
    assert resp.status_code == 200 and room.state is KVPoll.Success, resp.text
    cached = resp.json()["meta_info"]["cached_tokens"]
    assert cached == 40 // page_size * page_size, "the shared prefix (whole pages) comes from the cache"
    aux = peer.aux_record(room)
    assert aux.cached_tokens == cached
    assert aux.token_id == hf_first_token(model_dir, second)
    assert len(aux.top_ids) == 3 and aux.top_ids[0] == aux.token_id
    for (k, v), (hk, hv) in zip(peer.kv(room), hf_kv(model_dir, second)):
        torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-4)
    peer.release(room)


def test_node_returns_to_idle_baseline(setup) -> None:
    _, _, node, _ = setup
    deadline = time.monotonic() + 5.0
    mem = node.get("/debug/memory")
    while (mem["live_reqs"] or mem["transfer_rooms"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        mem = node.get("/debug/memory")
    assert mem["live_reqs"] == 0 and mem["held_pages"] == 0 and mem["transfer_rooms"] == 0
    assert mem["free_req_slots"] == mem["total_req_slots"]
    assert mem["free_pages"] + mem["cached_pages"] == mem["total_pages"] and mem["cached_pages"] > 0
    assert node.get("/get_load") == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
