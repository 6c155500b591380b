"""Bootstrap wire types, the decode compatibility check and the registry table (no network)."""
from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from bootstrap_server.errors import BootstrapError, LayoutMismatch
from bootstrap_server.registry import Registry, RegistryConflict
from bootstrap_server.schema import DecodeLayout, PrefillLayout, RankInfo, check_receivable


def body(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "role": "prefill",
        "rank_ip": "10.0.0.2",
        "rank_port": 17000,
        "engine_rank": 1,
        "tp_size": 2,
        "dp_size": 2,
        "dp_group": 1,
        "pp_size": 1,
        "pp_rank": 0,
        "page_size": 16,
        "kv_dtype": "bfloat16",
        "num_layers": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}  # ``...`` drops a field


def decode(obj: dict[str, Any]) -> RankInfo:
    return msgspec.json.decode(json.dumps(obj).encode(), type=RankInfo)


def info(**changes: Any) -> RankInfo:
    return decode(body(**changes))


def test_valid_body_decodes_and_round_trips() -> None:
    rank = info(session_id="10.0.0.2:15001", instance_id="abc", transfer_backend="mooncake")
    assert (rank.key, rank.endpoint, rank.session_id) == ((1, 1, 0), "tcp://10.0.0.2:17000", "10.0.0.2:15001")
    assert msgspec.json.decode(msgspec.json.encode(rank), type=RankInfo) == rank
    assert info(role=...).role == "prefill"  # the only role that registers; may be left out


@pytest.mark.parametrize("rank_ip", ["127.0.0.1", "::1", "fe80::1", "prefill-0.prefill.default.svc.cluster.local", "localhost"])
def test_rank_ip_accepts_addresses_and_host_names(rank_ip: str) -> None:
    assert info(rank_ip=rank_ip).rank_ip == rank_ip


def test_ipv6_endpoint_is_bracketed() -> None:
    assert info(rank_ip="::1").endpoint == "tcp://[::1]:17000"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rank_port": 0}, "rank_port"),
        ({"rank_port": 65536}, "rank_port"),
        ({"rank_port": "17000"}, "rank_port"),
        ({"rank_port": True}, "rank_port"),
        ({"tp_size": 2.0}, "tp_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"page_size": ...}, "page_size"),
        ({"page_size": 12}, "page_size"),
        ({"engine_rank": 2}, "engine_rank"),
        ({"engine_rank": -1}, "engine_rank"),
        ({"dp_group": 2}, "dp_group"),
        ({"pp_rank": 1}, "pp_rank"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -64}, "head_dim"),
        ({"num_kv_heads": None}, "num_kv_heads"),
        ({"rank_ip": ""}, "rank_ip"),
        ({"rank_ip": "0.0.0.0"}, "rank_ip"),
        ({"rank_ip": "::"}, "rank_ip"),
        ({"rank_ip": "bad host!"}, "rank_ip"),
        ({"role": "decode"}, "role"),
        ({"tp_rank": 1}, "tp_rank"),  # unknown field: a typo must not vanish silently
        ({"state_shapes": [[64, 3]]}, "state_dtype"),  # a state layout needs both halves
        ({"state_dtype": "float32"}, "state_dtype"),
        ({"state_shapes": [[64, 0]], "state_dtype": "float32"}, "state_shapes"),
        ({"state_shapes": [[]], "state_dtype": "float32"}, "state_shapes"),
    ],
)
def test_invalid_body_is_rejected_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        decode(body(**changes))


def prefill_layout(**changes: Any) -> PrefillLayout:
    return msgspec.structs.replace(PrefillLayout.of(info(), registered_ranks=4), **changes)


def decode_layout(**changes: Any) -> DecodeLayout:
    base = DecodeLayout(tp_size=2, pp_size=1, page_size=16, kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64)
    return msgspec.structs.replace(base, **changes)


def test_prefill_layout_counts_ranks() -> None:
    layout = prefill_layout()
    assert (layout.expected_ranks, layout.complete) == (4, True)
    assert not prefill_layout(registered_ranks=3).complete


def test_matching_layouts_are_receivable() -> None:
    check_receivable(prefill_layout(), decode_layout())
    # A prefill with more dp groups is fine (one group serves a request); an unnamed backend is not checked.
    check_receivable(prefill_layout(dp_size=4, transfer_backend="fake"), decode_layout())


@pytest.mark.parametrize(
    ("decode_changes", "named"),
    [
        ({"tp_size": 4}, "tp_size"),
        ({"pp_size": 2}, "pp_size"),
        ({"page_size": 32}, "page_size"),
        ({"kv_dtype": "float32"}, "kv_dtype"),
        ({"num_layers": 3}, "num_layers"),
        ({"num_kv_heads": 1, "head_dim": 128}, "num_kv_heads x head_dim"),  # same bytes, different rows
        ({"transfer_backend": "mooncake"}, "transfer_backend"),
        ({"state_shapes": ((64, 3),), "state_dtype": "bfloat16"}, "state_shapes"),  # hybrid decode, plain prefill
    ],
)
def test_mismatch_names_the_field(decode_changes: dict[str, Any], named: str) -> None:
    with pytest.raises(LayoutMismatch, match=named) as err:
        check_receivable(prefill_layout(transfer_backend="fake"), decode_layout(**decode_changes))
    assert isinstance(err.value, BootstrapError)


def test_mismatch_lists_every_difference() -> None:
    with pytest.raises(LayoutMismatch) as err:
        check_receivable(prefill_layout(), decode_layout(page_size=32, kv_dtype="float16"))
    assert "page_size: prefill 16, decode 32" in str(err.value)
    assert "kv_dtype: prefill bfloat16, decode float16" in str(err.value)


def test_decode_layout_from_the_real_kv_pool_layout() -> None:
    from common.kvcache.pool import KVLayout

    kv = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    assert DecodeLayout.from_kv_layout(kv, tp_size=2) == decode_layout()


# ---- Registry (the table behind the HTTP shell) ----


def test_registry_register_lookup_replace() -> None:
    reg = Registry()
    assert reg.layout() is None and reg.lookup(1, 1) is None
    first = info()
    assert reg.register(first) is None
    assert reg.lookup(1, 1, 0) == first
    restarted = info(rank_port=17001, instance_id="new")
    assert reg.register(restarted) == first
    assert reg.lookup(1, 1) == restarted
    assert reg.layout() == PrefillLayout.of(first, registered_ranks=1)


def test_registry_rejects_layout_mismatch_between_ranks() -> None:
    reg = Registry()
    reg.register(info(engine_rank=0, rank_port=17000))
    with pytest.raises(RegistryConflict, match="page_size 32 != 16"):
        reg.register(info(engine_rank=1, rank_port=17001, page_size=32))
    assert reg.lookup(1, 1) is None and len(reg.ranks()) == 1


def test_registry_lets_a_lone_rank_come_back_with_a_new_layout() -> None:
    reg = Registry()
    reg.register(info())
    reg.register(info(page_size=32))
    layout = reg.layout()
    assert layout is not None and layout.page_size == 32


def test_registry_rejects_two_ranks_on_one_endpoint() -> None:
    reg = Registry()
    reg.register(info(engine_rank=0))
    with pytest.raises(RegistryConflict, match="10.0.0.2:17000 is already registered"):
        reg.register(info(engine_rank=1))


def test_registry_deregister_guards_the_incarnation() -> None:
    reg = Registry()
    reg.register(info(instance_id="new"))
    with pytest.raises(RegistryConflict, match="'old'"):
        reg.deregister(1, 1, 0, instance_id="old")
    assert reg.lookup(1, 1) is not None
    assert reg.deregister(1, 1, 0, instance_id="new") is not None
    assert reg.deregister(1, 1, 0) is None


def test_registry_clear_and_order() -> None:
    reg = Registry()
    for dp_group, engine_rank in [(1, 1), (0, 1), (1, 0), (0, 0)]:
        reg.register(info(dp_group=dp_group, engine_rank=engine_rank, rank_port=17000 + 2 * dp_group + engine_rank))
    assert [r.key for r in reg.ranks()] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    layout = reg.layout()
    assert layout is not None and layout.complete
    assert reg.clear() == 4 and reg.ranks() == []


def test_state_layout_travels_and_is_compared() -> None:
    """A hybrid prefill registers its state layout; the decode compares shapes and dtype."""
    from common.kvcache.pool import KVLayout
    from common.kvcache.state_pool import StateLayout

    hybrid = info(state_shapes=[[64, 3], [64, 3]], state_dtype="bfloat16")
    assert decode(json.loads(msgspec.json.encode(hybrid))) == hybrid
    layout = PrefillLayout.of(hybrid, registered_ranks=4)
    kv = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    same = DecodeLayout.from_kv_layout(kv, tp_size=2, state=StateLayout(num_layers=2, shape=(64, 3), dtype="bfloat16"))
    check_receivable(layout, same)
    for other, named in [(StateLayout(2, (64, 4), "bfloat16"), "64x3, 64x3, decode 64x4, 64x4"),
                         (StateLayout(3, (64, 3), "bfloat16"), "state_shapes"),
                         (StateLayout(2, (64, 3), "float32"), "state_dtype")]:
        with pytest.raises(LayoutMismatch, match=named):
            check_receivable(layout, msgspec.structs.replace(same, state_shapes=((tuple(other.shape),) * other.num_layers),
                                                             state_dtype=other.dtype))
    with pytest.raises(LayoutMismatch, match="prefill none"):
        check_receivable(prefill_layout(), msgspec.structs.replace(decode_layout(), state_shapes=((64, 3),),
                                                                  state_dtype="bfloat16"))


# --- tensor parallelism: head ranges and unequal TP -------------------------------------------

def tp_prefill(tp: int, total: int, staging: bool = True, **changes: Any) -> PrefillLayout:
    heads = total // tp if tp <= total else 1
    return prefill_layout(tp_size=tp, num_kv_heads=heads, total_kv_heads=total, kv_staging=staging, **changes)


def tp_decode(tp: int, total: int, staging: bool = True, **changes: Any) -> DecodeLayout:
    heads = total // tp if tp <= total else 1
    return decode_layout(tp_size=tp, num_kv_heads=heads, total_kv_heads=total, kv_staging=staging, **changes)


def test_a_rank_registers_the_heads_it_holds() -> None:
    assert info(engine_rank=1, tp_size=2, num_kv_heads=2, total_kv_heads=4, kv_head_start=2).kv_head_start == 2
    assert info(engine_rank=3, tp_size=4, num_kv_heads=1, total_kv_heads=2, kv_head_start=1).total_kv_heads == 2


@pytest.mark.parametrize(("changes", "field"), [
    ({"total_kv_heads": 4, "kv_head_start": 0}, "rank 1 of tp_size 2 with total_kv_heads 4 holds heads 2..3"),
    ({"total_kv_heads": 4, "num_kv_heads": 1, "kv_head_start": 2}, "num_kv_heads 1"),  # back-computed wrong
    ({"total_kv_heads": 3, "kv_head_start": 1}, "not divisible"),
    ({"total_kv_heads": 4}, "come together"),
])
def test_a_head_range_that_contradicts_the_pool_contract_is_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        decode(body(**changes))


def test_ranks_of_one_node_must_agree_on_total_heads() -> None:
    reg = Registry()
    reg.register(info(engine_rank=0, dp_group=0, rank_port=1, total_kv_heads=4, kv_head_start=0))
    with pytest.raises(RegistryConflict, match="total_kv_heads"):
        reg.register(info(engine_rank=1, dp_group=0, rank_port=2, total_kv_heads=8, num_kv_heads=4, kv_head_start=4))


@pytest.mark.parametrize(("tp_p", "tp_d", "total"), [
    (p, d, 4) for p in (1, 2, 4) for d in (1, 2, 4)] + [(1, 4, 2), (4, 1, 2), (4, 2, 2), (2, 4, 2)])
def test_dividing_tp_sizes_are_receivable(tp_p: int, tp_d: int, total: int) -> None:
    check_receivable(tp_prefill(tp_p, total), tp_decode(tp_d, total))


@pytest.mark.parametrize(("prefill", "decode", "field"), [
    (tp_prefill(2, 6), tp_decode(3, 6), "tp_size: prefill 2 and decode 3 do not divide each other"),
    (tp_prefill(1, 4), tp_decode(3, 4), "total_kv_heads 4 is not divisible by decode tp_size 3"),
    (tp_prefill(2, 4), tp_decode(1, 8), "total_kv_heads: prefill 4, decode 8"),
    (tp_prefill(2, 4), tp_decode(1, 4, page_size=32), "page_size"),
    (tp_prefill(2, 4), tp_decode(1, 4, head_dim=128), "head_dim"),
    (tp_prefill(2, 4), tp_decode(1, 4, kv_dtype="float16"), "kv_dtype"),
    (tp_prefill(2, 4, state_shapes=((64, 3),), state_dtype="bfloat16"),
     tp_decode(1, 4, state_shapes=((64, 3),), state_dtype="bfloat16"), "state_shapes: per-rank recurrent state"),
    (tp_prefill(2, 4), tp_decode(1, 4, staging=False), "kv_staging: decode"),
    (tp_prefill(1, 4, staging=False), tp_decode(2, 4), "kv_staging: prefill"),
    (prefill_layout(tp_size=2), tp_decode(1, 4), "total_kv_heads: the prefill did not register it"),
])
def test_unservable_tp_pairs_name_the_field(prefill: PrefillLayout, decode: DecodeLayout, field: str) -> None:
    with pytest.raises(LayoutMismatch, match=field):
        check_receivable(prefill, decode)


def test_equal_tp_needs_no_staging_and_accepts_an_older_prefill() -> None:
    check_receivable(tp_prefill(2, 4, staging=False), tp_decode(2, 4, staging=False))
    check_receivable(prefill_layout(), decode_layout())  # no total_kv_heads registered: equal TP still works
