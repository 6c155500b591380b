"""Pure parts of the transfer layer: state rules, descriptors, aux rows, messages, registry."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kvcache.pool import KVLayout, KVPool
from transfer import messages as m
from transfer.args import BufferSet, KVArgs
from transfer.aux import AuxPool, AuxRecord
from transfer.descriptors import build, merge_runs, split
from transfer.errors import TransferError
from transfer.poll import KVPoll, can_advance
from transfer.registry import available_backends, create_data_plane


def test_kvpoll_values_and_min_reduce() -> None:
    assert [int(s) for s in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)] == [0, 1, 2, 3, 4]
    assert min(KVPoll.Success, KVPoll.Failed, KVPoll.Transferring) is KVPoll.Failed


def test_kvpoll_transitions_forward_only_and_terminal_sticky() -> None:
    for cur in KVPoll:
        for new in KVPoll:
            expected = (not cur.terminal) and (new is KVPoll.Failed or new > cur)
            assert can_advance(cur, new) == expected, (cur, new)


def _reference_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_merge_runs_matches_reference(pairs: list[tuple[int, int]]) -> None:
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    s0, d0, n = merge_runs(src, dst)
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist())) == _reference_runs(src, dst)


def test_build_descriptors_bytes_and_order() -> None:
    # pages 3,4,5 -> 7,8,9 is one run; 9 -> 2 another; two buffers of different page sizes
    d = build([3, 4, 5, 9], [7, 8, 9, 2], src_ptrs=[1000, 5000], dst_ptrs=[100_000, 200_000], item_nbytes=[10, 20])
    assert d.src == [1000 + 30, 1000 + 90, 5000 + 60, 5000 + 180]
    assert d.dst == [100_000 + 70, 100_000 + 20, 200_000 + 140, 200_000 + 40]
    assert d.lens == [30, 10, 60, 20]
    assert len(build([], [], [1], [2], [3])) == 0
    with pytest.raises(ValueError):
        build([1, 2], [1], [0], [0], [1])


def test_split_respects_limit_and_keeps_everything() -> None:
    d = build(list(range(0, 20, 2)), list(range(10)), [0] * 3, [0] * 3, [1] * 3)  # 10 runs x 3 buffers
    parts = list(split(d, 7))
    assert [len(p) for p in parts] == [7, 7, 7, 7, 2]
    assert sum((p.src for p in parts), []) == d.src


def test_aux_pool_roundtrip_slots_and_layout() -> None:
    pool = AuxPool(3, top_k=4)
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.alloc() is None
    rec = AuxRecord(room=2**63 - 1, token_id=42, cached_tokens=16, logprob=-0.25, top_ids=(42, 7), top_logprobs=(-0.25, -2.0))
    pool.write(slots[1], rec)
    assert pool.read(slots[1]) == rec
    digested = AuxRecord(room=5, token_id=1, cached_tokens=0, kv_digest=bytes(range(1, 17)))
    pool.write(slots[2], digested)
    assert pool.read(slots[2]) == digested
    with pytest.raises(ValueError):
        pool.write(slots[2], AuxRecord(room=5, token_id=1, cached_tokens=0, kv_digest=b"short"))
    assert pool.read(slots[0]).token_id == 0  # rows are independent
    assert pool.row_nbytes % 8 == 0 and pool.rows.shape == (3, pool.row_nbytes)
    with pytest.raises(ValueError):
        pool.write(slots[0], AuxRecord(room=1, token_id=1, cached_tokens=0, top_ids=(1,) * 5, top_logprobs=(0.0,) * 5))
    pool.free(slots[1])
    assert pool.read(slots[1]).room == 0  # freed rows are cleared
    with pytest.raises(ValueError):
        pool.free(slots[1])
    pool.check_integrity()


def test_kvargs_from_pool_and_validation() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
    pool = KVPool(layout, num_pages=5, device="cpu")
    kv = KVArgs.kv_from_pool(pool)
    assert len(kv) == 4 and kv.num_items() == 5 and set(kv.item_nbytes) == {4 * 2 * 4 * 4}
    aux = AuxPool(2, top_k=1)
    args = KVArgs(layout=layout, kv=kv, aux=aux.buffers(), aux_top_k=1)
    assert len(args.all_buffers()) == 5
    with pytest.raises(ValueError):
        KVArgs(layout=layout, kv=kv, aux=aux.buffers(), aux_top_k=3)  # row size disagrees
    with pytest.raises(ValueError):
        BufferSet((1,), (10,), (3,))  # not a whole number of items


def test_messages_roundtrip_and_malformed() -> None:
    info = m.TransferInfo(room=2**63 - 1, session_id="h:1", instance_id="i", status_endpoint="tcp://h:2",
                          dst_pages=[1, 2, 3], aux_slot=None)
    assert m.decode_to_prefill(m.encode(info)) == info
    st_ = m.TransferStatus(room=5, status=int(KVPoll.Success), prefill_rank=0)
    assert m.decode_to_decode(m.encode(st_)) == st_
    for bad in (b"", b"\xc1garbage", m.encode(st_)):  # a status is not a prefill-bound message
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            m.decode_to_prefill(bad)
    with pytest.raises(msgspec.ValidationError):
        m.decode_to_decode(msgspec.msgpack.encode({"type": "status", "room": "x"}))


def test_registry_fake_and_unknown() -> None:
    assert available_backends() == ["fake", "mooncake"]
    fake = create_data_plane("fake", host="127.0.0.1", max_batch_entries=3)
    assert fake.name == "fake" and fake.session_id.startswith("fake-")
    assert not fake.write("x", build([0, 2, 4, 6], [0, 2, 4, 6], [0], [0], [1]))  # 4 > 3 entries
    fake.close()
    with pytest.raises(TransferError, match="unknown transfer backend"):
        create_data_plane("rdma-magic", host="127.0.0.1")


def test_merge_runs_large_is_vectorised() -> None:
    src = np.arange(100_000)
    s0, _, n = merge_runs(src, src + 5)
    assert s0.tolist() == [0] and n.tolist() == [100_000]
