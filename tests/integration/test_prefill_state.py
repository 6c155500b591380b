"""A running prefill node serving a hybrid model (LFM2) writes each request's recurrent state,
with its KV, into the slot a decode reserved (real Mooncake over TCP).

The decode side here is ``DecodePeer`` with state buffers registered. After each prompt, the
conv state in its slot must equal HF ``transformers``' conv cache for the same prompt (the last
``conv_L_cache`` convolution inputs of every conv layer), the attention layers' pages must equal
HF's keys/values, and the aux first token must be HF's greedy one: for prompts shorter than the
convolution, of one chunk, and of several chunks (the state crosses chunk boundaries). A decode
whose state layout differs is refused at bootstrap lookup, before any byte moves.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from _decode_peer import DecodePeer, PrefillNodeProc
from common.kvcache.pool import KVLayout
from common.kvcache.state_pool import StateLayout
from tests.reference import hf_model
from transfer import KVPoll

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.integration

CHUNK = 8
PAGE = 16


def hf_cache(model_dir: str, ids: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], int]:
    """HF's (K, V) per attention layer [T, kv_heads, head_dim], conv state per conv layer
    [hidden, kernel], and the greedy first token, for ``ids``."""
    with torch.inference_mode():
        out = hf_model(model_dir)(input_ids=torch.tensor([ids]), use_cache=True)
    kv, states = [], []
    for i, kind in enumerate(hf_model(model_dir).config.layer_types):
        if kind == "conv":
            states.append(out.cache.get_conv_state(i, state_idx=0)[0].float())
        else:
            lay = out.cache.layers[i]
            kv.append((lay.keys[0].transpose(0, 1).float(), lay.values[0].transpose(0, 1).float()))
    return kv, states, int(torch.argmax(out.logits[0, -1]))


def layouts(model_dir: str) -> tuple[KVLayout, StateLayout]:
    cfg = hf_model(model_dir).config
    n_attn = sum(t != "conv" for t in cfg.layer_types)
    kv = KVLayout(n_attn, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, PAGE, "float32")
    return kv, StateLayout(len(cfg.layer_types) - n_attn, (cfg.hidden_size, cfg.conv_L_cache), "float32")


@pytest.fixture(scope="module")
def setup(tiny_lfm2: str, tmp_path_factory) -> Iterator[tuple[PrefillNodeProc, DecodePeer]]:
    log = str(tmp_path_factory.mktemp("prefill-state-log") / "node.log")
    node = PrefillNodeProc(tiny_lfm2, "--disaggregation-transfer-backend", "mooncake", "--page-size", str(PAGE),
                           "--chunked-prefill-size", str(CHUNK), "--max-prefill-tokens", "64",
                           "--max-total-tokens", "4096", "--max-running-requests", "16", log_path=log)
    peer = None
    try:
        node.wait_ready()
        kv, state = layouts(tiny_lfm2)
        peer = DecodePeer(kv, state=state)
        yield node, peer
    finally:
        if peer is not None:
            peer.close()
        node.stop()


def test_state_and_kv_equal_hf_cache(setup, tiny_lfm2: str) -> None:
    node, peer = setup
    vocab = hf_model(tiny_lfm2).config.vocab_size
    g = torch.Generator().manual_seed(5)
    for n in (2, CHUNK, 29):  # shorter than the conv (zero-padded state) ... four chunks
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        room, resp = peer.generate(node, ids)
        assert resp.status_code == 200, resp.text
        assert room.state is KVPoll.Success, room.reason
        want_kv, want_states, first = hf_cache(tiny_lfm2, ids)
        got_states = peer.state_of(room)
        assert len(got_states) == len(want_states) == 3
        for layer, (got, want) in enumerate(zip(got_states, want_states)):
            assert got.abs().sum() > 0, f"conv layer {layer}: nothing arrived"
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"state {layer}, {n} tokens: {m}")
        for layer, ((k, v), (hk, hv)) in enumerate(zip(peer.kv(room), want_kv)):
            torch.testing.assert_close(k, hk, atol=1e-5, rtol=1e-4, msg=lambda m: f"K {layer}, {n} tokens: {m}")
            torch.testing.assert_close(v, hv, atol=1e-5, rtol=1e-4, msg=lambda m: f"V {layer}, {n} tokens: {m}")
        assert peer.aux_record(room).token_id == first
        assert resp.json()["meta_info"]["cached_tokens"] == 0  # no prefix cache for a stateful model
        peer.release(room)


def test_decode_with_another_state_layout_is_refused_at_lookup(setup, tiny_lfm2: str) -> None:
    node, _ = setup
    kv, state = layouts(tiny_lfm2)
    other = DecodePeer(kv, state=StateLayout(state.num_layers, (state.shape[0], state.shape[1] + 1), state.dtype))
    try:
        # Only the decode side: its lookup alone must refuse (no request reaches the prefill).
        room = other.open(other.new_room(), f"127.0.0.1:{node.bootstrap_port}", 4, timeout_s=10.0)
        assert room.state is KVPoll.Failed
        reason = room.receiver.failure_reason or ""
        assert "state_shapes" in reason and "64x3" in reason and "64x4" in reason, reason
    finally:
        other.close()


def test_node_returns_to_idle(setup) -> None:
    node, _ = setup
    deadline = time.monotonic() + 10.0
    mem = node.get("/debug/memory")
    while (mem["live_reqs"] or mem["transfer_rooms"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        mem = node.get("/debug/memory")
    assert mem["live_reqs"] == 0 and mem["transfer_rooms"] == 0
    assert mem["free_state_slots"] == mem["total_state_slots"] == mem["total_req_slots"] == mem["free_req_slots"]
    assert mem["free_pages"] == mem["total_pages"] and mem["cached_pages"] == 0
