"""The TP head mapping: every decode rank receives each of its heads exactly once, from a rank
that holds it, at the right offsets; unservable pairs raise ``LayoutMismatch`` naming the field."""
from __future__ import annotations

import itertools

import pytest

from bootstrap_server.errors import LayoutMismatch
from transfer.tp_map import plan


def _heads_of(tp: int, num_heads: int, rank: int) -> list[int]:
    """The pool contract written out independently: global head ids at each local offset."""
    if tp <= num_heads:
        per = num_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // num_heads)]


def _simulate(tp_p: int, tp_d: int, num_heads: int) -> list[list[list[int]]]:
    """Apply the plan to per-rank pools holding their global head ids; per decode rank, per
    local offset, the list of global heads written there."""
    m = plan(tp_p, tp_d, num_heads)
    src = [_heads_of(tp_p, num_heads, p) for p in range(tp_p)]
    out = [[[] for _ in _heads_of(tp_d, num_heads, d)] for d in range(tp_d)]
    for p, d in itertools.product(range(tp_p), range(tp_d)):
        for s in m.slices_to(p, d):
            for i in range(s.num_heads):
                out[d][s.dst_head_offset + i].append(src[p][s.src_head_offset + i])
    return out


CASES = [(p, d, 4) for p in (1, 2, 4) for d in (1, 2, 4)] + [(1, 4, 2), (2, 4, 2), (4, 4, 2), (4, 2, 2), (8, 2, 2)]


@pytest.mark.parametrize("tp_p,tp_d,num_heads", CASES)
def test_each_decode_head_arrives_once_from_a_holder(tp_p: int, tp_d: int, num_heads: int) -> None:
    got = _simulate(tp_p, tp_d, num_heads)
    for d in range(tp_d):
        assert got[d] == [[h] for h in _heads_of(tp_d, num_heads, d)], f"decode rank {d}"


@pytest.mark.parametrize("tp_p,tp_d,num_heads", CASES)
def test_every_prefill_rank_hears_from_its_destinations_or_one_informant(
    tp_p: int, tp_d: int, num_heads: int
) -> None:
    m = plan(tp_p, tp_d, num_heads)
    for p in range(tp_p):
        naming = [d for d in range(tp_d) if p in m.sources(d)]
        assert m.destinations(p) == tuple(naming)
        # an unused replica still hears from exactly one decode rank, so its room ends too
        assert m.informants(p) == (tuple(naming) or (p % tp_d,))
        assert m.required_dst_info_num(p) == len(m.informants(p)) >= 1
    for d in range(tp_d):
        # every source a decode rank waits for actually sends it something
        assert all(m.slices_to(p, d) for p in m.sources(d))
        assert m.aux_rank(d) in m.sources(d)
        # a decode rank contacts its sources and the replicas it informs, nothing else
        assert m.contacts(d) == tuple(p for p in range(tp_p) if d in m.informants(p))
        assert set(m.sources(d)) <= set(m.contacts(d))
    # each prefill rank's TransferInfos come from exactly required_dst_info_num decode ranks
    for p in range(tp_p):
        assert sum(p in m.contacts(d) for d in range(tp_d)) == m.required_dst_info_num(p)


def test_equal_tp_is_one_slice_from_the_same_rank() -> None:
    m = plan(4, 4, 8)
    for d in range(4):
        assert [(s.src_rank, s.src_head_offset, s.dst_head_offset, s.num_heads) for s in m.recv[d]] == [(d, 0, 0, 2)]


def test_replicated_prefill_spreads_the_load_across_replicas() -> None:
    # 2 KV heads over 8 prefill ranks: 4 replicas each; 4 decode ranks hold head 0 twice and head 1 twice
    m = plan(8, 4, 2)
    senders = [m.sources(d) for d in range(4)]
    assert len({s for (s,) in senders}) == 4  # no replica sends twice while another idles


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prefill_tp=2, decode_tp=3, num_kv_heads=4), "tp_size: prefill 2 and decode 3 do not divide"),
        (dict(prefill_tp=2, decode_tp=3, num_kv_heads=6), "tp_size: prefill 2 and decode 3 do not divide"),
        (dict(prefill_tp=3, decode_tp=1, num_kv_heads=4), "prefill tp_size"),
        (dict(prefill_tp=1, decode_tp=2, num_kv_heads=3), "total_kv_heads 3 is not divisible by decode tp_size"),
        (dict(prefill_tp=1, decode_tp=6, num_kv_heads=4), "decode tp_size"),
        (dict(prefill_tp=1, decode_tp=2, num_kv_heads=4, prefill_page_size=16, decode_page_size=32), "page_size"),
        (dict(prefill_tp=1, decode_tp=2, num_kv_heads=4, has_sharded_state=True), "state_layout"),
    ],
)
def test_unservable_pairs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LayoutMismatch, match=field):
        plan(**kwargs)


def test_sharded_state_is_fine_at_equal_tp() -> None:
    assert plan(2, 2, 4, has_sharded_state=True).sources(1) == (1,)
