"""common/tools/roofline.py against hand-computed values."""
from __future__ import annotations

from common.tools.roofline import Shape, decode_bytes, decode_flops, prefill_flops, roofline_s

# hidden 4, 1 layer, 2 heads of dim 2, 1 kv head, intermediate 8, vocab 10
TOY = Shape(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)


def test_from_config_fills_defaults_like_hf() -> None:
    cfg = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152}
    s = Shape.from_config(cfg)
    assert (s.head_dim, s.kv_heads) == (64, 3)
    assert Shape.from_config({**cfg, "num_key_value_heads": None}).kv_heads == 9
    assert Shape.from_config({**cfg, "head_dim": 128}).head_dim == 128


def test_weights_counted_by_hand() -> None:
    # q 4x4=16, o 16, k 4x2=8, v 8, gate/up/down 3*4*8=96 -> 144 per layer; head 10*4=40
    assert TOY.layer_weights == 144
    assert TOY.linear_weights == 184


def test_smollm2_135m_weights_match_its_parameter_count() -> None:
    s = Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
    # published 134.5M parameters = linears + tied embedding/head (counted once) + norms
    norms = 576 * (2 * 30 + 1)
    assert s.linear_weights + norms == 134_515_008


def test_prefill_flops_by_hand() -> None:
    # 3 tokens: linears 2*3*144 = 864; head for 1 token 2*40 = 80; attention 1*2*2*2*2*(1+2+3)=96
    assert prefill_flops(TOY, 3) == 864 + 80 + 96
    assert prefill_flops(TOY, 3, logits_tokens=3) == 864 + 240 + 96


def test_decode_flops_and_bytes_by_hand() -> None:
    # batch 2, context 5: linears 2*2*184 = 736; attention 2*1*2*2*2*2*5 = 160
    assert decode_flops(TOY, 2, 5) == 736 + 160
    # bytes: weights 184 + kv 2*1*2*1*2*5 = 40, at 4 bytes
    assert decode_bytes(TOY, 2, 5) == 4 * (184 + 40)
    assert decode_bytes(TOY, 2, 5, dtype_bytes=2) == 2 * (184 + 40)
    # bfloat16 projections (144 per layer), float32 head (40) and KV (40)
    assert decode_bytes(TOY, 2, 5, weight_bytes=2) == 2 * 144 + 4 * (40 + 40)


def test_roofline_takes_the_slower_bound() -> None:
    assert roofline_s(flops=100, nbytes=10, peak_flops=10.0, bandwidth=10.0) == 10.0
    assert roofline_s(flops=10, nbytes=100, peak_flops=10.0, bandwidth=10.0) == 10.0
