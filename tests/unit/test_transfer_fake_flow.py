"""Both managers in one process with the fake data plane: the state machine, the control plane and
the failure paths (no bytes move; ZMQ runs over loopback, the bootstrap registry is in memory)."""
from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import torch
import zmq

from common.kvcache.pool import KVLayout
from tests.unit.transfer_harness import (  # noqa: F401  (cluster is a fixture)
    ADDR,
    CFG,
    LAYOUT,
    Cluster,
    cluster,
    handshake,
    make_side,
    until_terminal,
    wait_for,
)
from transfer.aux import AuxRecord
from transfer.config import KVManagerConfig
from transfer.errors import TransferError
from transfer.poll import KVPoll

def test_happy_path_chunks_descriptors_and_states(cluster: Cluster) -> None:
    pm, p = cluster.prefill()
    dm, _ = cluster.decode()
    sender, recv = handshake(pm, dm, room=7, dst_pages=[5, 6, 7, 8, 2])
    sender.send(torch.tensor([1, 2]), last_chunk=False)  # tensors, arrays and lists all work
    assert sender.poll() is KVPoll.Transferring
    sender.send([3, 9, 10], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
    assert until_terminal(sender)[0] is KVPoll.Success
    assert until_terminal(recv)[0] is KVPoll.Success
    # chunk 1: 1,2 -> 5,6 one run; chunk 2: 3 -> 7 and 9,10 -> 8,2 (dst breaks) three runs; +1 aux row
    assert p.engine.descriptors == (1 + 3) * LAYOUT.num_layers * 2 + 1
    assert sender.poll() is KVPoll.Success and recv.poll() is KVPoll.Success  # sticky
    wait_for(lambda: pm.num_rooms() == 0 and dm.num_rooms() == 0)


def woken_until(obj: object, woken: threading.Event, target: KVPoll, timeout: float = 5.0) -> None:
    """Wait as the node loops do, re-polling only when the manager's state listener fired: every
    state change on the way to ``target`` must come with a wake, or this times out."""
    while True:
        woken.clear()  # before the poll: a change after it sets the event again
        if obj.poll() is target:  # type: ignore[attr-defined]
            return
        assert woken.wait(timeout), f"no wake while {obj.poll().name}, waiting for {target.name}"  # type: ignore[attr-defined]


def test_every_state_change_wakes_the_scheduler(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    p_woken, d_woken = threading.Event(), threading.Event()
    pm.set_state_listener(p_woken.set)
    dm.set_state_listener(d_woken.set)
    sender = pm.create_sender(21)
    recv = dm.create_receiver(21, ADDR)
    woken_until(recv, d_woken, KVPoll.WaitingForInput)  # connected to the prefill
    recv.init([1, 2], aux_slot=0)
    woken_until(sender, p_woken, KVPoll.WaitingForInput)  # the TransferInfo arrived
    sender.send([3, 4], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
    woken_until(sender, p_woken, KVPoll.Success)  # the last write returned
    woken_until(recv, d_woken, KVPoll.Success)  # the prefill's status arrived
    # failures too: a prefill-side abort fails the decode's room
    sender = pm.create_sender(22)
    recv = dm.create_receiver(22, ADDR)
    woken_until(recv, d_woken, KVPoll.WaitingForInput)
    recv.init([5], aux_slot=1)
    woken_until(sender, p_woken, KVPoll.WaitingForInput)
    sender.abort("prefill gave up")
    woken_until(recv, d_woken, KVPoll.Failed)


def test_transfer_info_before_sender_and_batch_split(cluster: Cluster) -> None:
    cfg = KVManagerConfig(**{**CFG.__dict__, "max_batch_entries": 5})
    pm, p = cluster.prefill(cfg=cfg)
    dm, _ = cluster.decode()
    recv = dm.create_receiver(3, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([1, 3, 5, 7], aux_slot=None)  # prefill has no sender for room 3 yet
    time.sleep(0.05)
    sender = pm.create_sender(3)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([1, 2, 3, 4], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
    assert p.engine.descriptors == 4 * 6 and p.engine.batches == 5  # 24 descriptors in batches of <= 5


def test_send_before_ready_and_page_count_mismatch(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    early = pm.create_sender(1)
    with pytest.raises(TransferError, match="room 1"):
        early.send([1], last_chunk=True)
    sender, recv = handshake(pm, dm, room=2, dst_pages=[1, 2, 3])
    sender.send([4, 5], last_chunk=True)  # 2 pages for 3 reserved
    st, _ = until_terminal(sender)
    assert st is KVPoll.Failed and "reserved 3" in (sender.failure_reason or "")
    st, _ = until_terminal(recv)
    assert st is KVPoll.Failed and "reserved 3" in (recv.failure_reason or "")
    early.abort()
    assert until_terminal(early)[0] is KVPoll.Failed


def test_prefill_bootstrap_timeout(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    sender = pm.create_sender(11)
    st, took = until_terminal(sender, timeout=3)
    assert st is KVPoll.Failed and "bootstrap timeout" in (sender.failure_reason or "")
    assert CFG.bootstrap_timeout_s <= took < CFG.bootstrap_timeout_s + 1


def test_decode_abort_before_and_after_init(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    s1 = pm.create_sender(1)
    r1 = dm.create_receiver(1, ADDR)
    wait_for(lambda: r1.poll() is KVPoll.WaitingForInput)
    r1.abort("client went away")
    assert r1.poll() is KVPoll.Failed  # nothing sent yet: fails at once
    st, took = until_terminal(s1)
    assert st is KVPoll.Failed and "client went away" in (s1.failure_reason or "") and took < 0.5

    s2, r2 = handshake(pm, dm, room=2, dst_pages=[1])
    r2.abort("client went away")
    st, _ = until_terminal(r2)  # fenced: Failed only after the prefill answered
    assert st is KVPoll.Failed and "client went away" in (r2.failure_reason or "")
    assert until_terminal(s2)[0] is KVPoll.Failed
    s2.send([1], last_chunk=True)  # late send of a failed room is a no-op


def test_prefill_abort_reaches_decode(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    sender, recv = handshake(pm, dm, room=5, dst_pages=[1, 2])
    sender.abort("prefill OOM")
    assert until_terminal(sender)[0] is KVPoll.Failed
    st, _ = until_terminal(recv)
    assert st is KVPoll.Failed and "prefill OOM" in (recv.failure_reason or "")


def test_waiting_timeout_aborts_and_fences(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    sender, recv = handshake(pm, dm, room=9, dst_pages=[1])  # prefill never sends
    st, took = until_terminal(recv, timeout=4)
    assert st is KVPoll.Failed and "waiting timeout" in (recv.failure_reason or "")
    assert took >= CFG.waiting_timeout_s - 0.1
    assert until_terminal(sender)[0] is KVPoll.Failed


def test_write_failure_fails_peer_rooms_then_recovers(cluster: Cluster) -> None:
    pm, p = cluster.prefill()
    dm, d = cluster.decode()
    s1, r1 = handshake(pm, dm, room=1, dst_pages=[1])
    s2, r2 = handshake(pm, dm, room=2, dst_pages=[2])
    p.engine.fail_session(d.engine.session_id)
    s1.send([3], last_chunk=True)
    for obj in (s1, r1, s2, r2):  # room 2 is bound to the same unreachable decode
        st, _ = until_terminal(obj)
        assert st is KVPoll.Failed and "unreachable" in (obj.failure_reason or ""), obj.failure_reason
    # The prefill forgot the decode; the decode re-registers after the "unregistered" answer.
    p.engine.fail_session(d.engine.session_id, failing=False)
    s3 = pm.create_sender(3)
    r3 = dm.create_receiver(3, ADDR)
    wait_for(lambda: r3.poll() is KVPoll.WaitingForInput)
    r3.init([4], 1)
    assert until_terminal(r3)[0] is KVPoll.Failed and "no KV args" in (r3.failure_reason or "")
    s3.abort()
    sender, recv = handshake(pm, dm, room=4, dst_pages=[4])
    sender.send([5], last_chunk=True)
    assert until_terminal(recv)[0] is KVPoll.Success


def test_malformed_messages_are_dropped(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    ctx = zmq.Context()
    try:
        for endpoint in (pm.endpoint, dm.status_endpoint):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(endpoint)
            sock.send(b"\x00not msgpack")
            sock.send_multipart([b"two", b"frames"])
            sock.send(msgspec.msgpack.encode({"type": "transfer_info", "room": "x"}))
            sock.send(msgspec.msgpack.encode({"type": "status", "room": 1, "status": 4, "prefill_rank": 0}))  # unknown room
            sock.close()
    finally:
        ctx.term()
    time.sleep(0.1)
    sender, recv = handshake(pm, dm, room=12, dst_pages=[1])
    sender.send([1], last_chunk=True)
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success


def test_layout_mismatch_fails_at_lookup_with_reason(cluster: Cluster) -> None:
    cluster.prefill()
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
    dm, _ = cluster.decode(make_side(other))
    for room in (1, 2):  # the second is answered from the negative cache just as clearly
        recv = dm.create_receiver(room, ADDR)
        st, took = until_terminal(recv)
        assert st is KVPoll.Failed and "head_dim" in (recv.failure_reason or "") and took < 1


def test_aux_row_mismatch_is_reported(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode(make_side(top_k=5))
    pm.create_sender(1)
    recv = dm.create_receiver(1, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([1], 0)
    st, _ = until_terminal(recv)
    assert st is KVPoll.Failed and "aux row bytes" in (recv.failure_reason or "")


def test_unreachable_bootstrap(cluster: Cluster) -> None:
    dm, _ = cluster.decode()
    recv = dm.create_receiver(1, "127.0.0.1:9")
    st, _ = until_terminal(recv)
    assert st is KVPoll.Failed and "unreachable" in (recv.failure_reason or "")


def test_prefill_death_fails_rooms_and_restart_serves(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    _, r1 = handshake(pm, dm, room=1, dst_pages=[1])  # TransferInfo out: fenced
    s2 = pm.create_sender(2)
    r2 = dm.create_receiver(2, ADDR)
    wait_for(lambda: r2.poll() is KVPoll.WaitingForInput)
    port = int(pm.endpoint.rsplit(":", 1)[1])
    pm._push.close()  # killed, not shut down: no goodbye reaches the decode
    pm.close()  # the control port closes: declared dead and confirmed gone
    for recv in (r1, r2):
        st, took = until_terminal(recv, timeout=3)
        assert st is KVPoll.Failed and "heartbeat" in (recv.failure_reason or "")
        assert took <= CFG.heartbeat_bound_s + 0.5
    del s2
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    pm2, _ = cluster.prefill()  # restarted: registers a new endpoint and instance
    sender, recv = handshake(pm2, dm, room=3, dst_pages=[2])
    sender.send([1], last_chunk=True)
    assert until_terminal(recv)[0] is KVPoll.Success


def test_hung_prefill_quarantines_pages(cluster: Cluster) -> None:
    """A prefill that stops answering but keeps its port open may still write: hold the room."""
    cfg = KVManagerConfig(**{**CFG.__dict__, "waiting_timeout_s": 30.0})
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode(cfg=cfg)
    _, recv = handshake(pm, dm, room=1, dst_pages=[1])
    pm._push.send = lambda endpoint, msg: True  # type: ignore[method-assign]  # mute, port still open
    st, took = until_terminal(recv, timeout=5)
    assert st is KVPoll.Failed and "heartbeat" in (recv.failure_reason or "")
    assert took >= CFG.heartbeat_interval_s * CFG.heartbeat_max_failures + CFG.hung_peer_quarantine_s - 0.05


def test_decode_restart_with_same_session_fails_old_rooms(cluster: Cluster) -> None:
    cfg = KVManagerConfig(**{**CFG.__dict__, "idle_peer_purge_s": 0.3})
    pm, _ = cluster.prefill(cfg=cfg)
    dm1, d1 = cluster.decode()
    s1, _ = handshake(pm, dm1, room=1, dst_pages=[1])
    dm1.close()
    d2 = make_side()
    d2.engine._session = d1.engine.session_id  # a restarted decode that got the same rpc port
    dm2, _ = cluster.decode(d2)
    s2, r2 = handshake(pm, dm2, room=2, dst_pages=[2])
    st, _ = until_terminal(s1)
    assert st is KVPoll.Failed and "restarted" in (s1.failure_reason or "")
    s2.send([3], last_chunk=True)
    assert until_terminal(r2)[0] is KVPoll.Success and until_terminal(s2)[0] is KVPoll.Success
    dm2.close()  # silent from now on, no rooms: the prefill forgets it
    wait_for(lambda: not pm.tables()["decodes"], timeout=3)


def test_duplicate_room_is_rejected(cluster: Cluster) -> None:
    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    pm.create_sender(1)
    dm.create_receiver(1, ADDR)
    with pytest.raises(TransferError):
        pm.create_sender(1)
    with pytest.raises(TransferError):
        dm.create_receiver(1, ADDR)


def test_many_rooms_with_random_aborts_all_settle(cluster: Cluster) -> None:
    """Rooms in every phase, aborted from either side at random moments: every room ends, a room
    ends Success on both sides or Failed on both, and both managers forget every room."""
    import random

    rng = random.Random(0)
    cfg = KVManagerConfig(**{**CFG.__dict__, "bootstrap_timeout_s": 20.0, "waiting_timeout_s": 20.0})
    pm, _ = cluster.prefill(cfg=cfg)
    dm, _ = cluster.decode(cfg=cfg)
    rooms = list(range(100, 160))
    senders = {r: pm.create_sender(r) for r in rooms}
    recvs = {r: dm.create_receiver(r, ADDR) for r in rooms}
    plan = {r: rng.choice(["ok", "ok", "p_early", "d_early", "p_mid", "d_mid"]) for r in rooms}
    for r in rooms:
        if plan[r] == "d_early":
            recvs[r].abort("d_early")
    wait_for(lambda: all(recvs[r].poll() in (KVPoll.WaitingForInput, KVPoll.Failed) for r in rooms))
    for r in rooms:
        if plan[r] == "p_early":
            senders[r].abort("p_early")
        if recvs[r].poll() is KVPoll.WaitingForInput:
            recvs[r].init([r % 7 + 1, r % 7 + 2], r % 4)
    wait_for(lambda: all(senders[r].poll() in (KVPoll.WaitingForInput, KVPoll.Failed) for r in rooms))
    for r in rooms:
        if senders[r].poll() is KVPoll.WaitingForInput:
            senders[r].send([1], last_chunk=False)
            if plan[r] == "p_mid":
                senders[r].abort("p_mid")
            if plan[r] == "d_mid":
                recvs[r].abort("d_mid")
            senders[r].send([2], last_chunk=True, aux=AuxRecord(room=r, token_id=1, cached_tokens=0))
    ends = {r: (until_terminal(senders[r])[0], until_terminal(recvs[r])[0]) for r in rooms}
    for r, (s, d) in ends.items():
        if plan[r] == "ok":
            assert (s, d) == (KVPoll.Success, KVPoll.Success), (r, plan[r], senders[r].failure_reason, recvs[r].failure_reason)
        elif plan[r] == "d_mid":  # the prefill may finish first (Success); the decode still reports its abort
            assert d is KVPoll.Failed, (r, plan[r])
        else:
            assert (s, d) == (KVPoll.Failed, KVPoll.Failed), (r, plan[r])
    wait_for(lambda: pm.num_rooms() == 0 and dm.num_rooms() == 0)


def state_side(num_slots: int = 4, width: int = 3):  # type: ignore[no-untyped-def]
    """A side with two state buffers (conv layers) of [6, width] float32 items besides its KV."""
    from common.kvcache.state_pool import StateLayout, StatePool
    from transfer.args import KVArgs

    side = make_side()
    states = StatePool(StateLayout(num_layers=2, shape=(6, width), dtype="float32"), num_slots, "cpu")
    side.args = KVArgs(layout=side.args.layout, kv=side.args.kv, aux=side.args.aux, aux_top_k=side.args.aux_top_k,
                       state=KVArgs.state_from_pool(states), state_layout=states.layout)
    return side, states


def test_state_slots_travel_with_the_last_chunk(cluster: Cluster) -> None:
    (p, _), (d, _) = state_side(), state_side()
    pm, p = cluster.prefill(p)
    dm, _ = cluster.decode(d)
    sender = pm.create_sender(11)
    recv = dm.create_receiver(11, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([5, 6], 0, [3])
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([1], last_chunk=False)  # an intermediate chunk carries no state
    sender.send([2], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0), state_indices=[1])
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
    # two KV chunks of one page each, the aux row, then one descriptor per state buffer (slot 1 -> 3)
    assert p.engine.descriptors == 2 * LAYOUT.num_layers * 2 + 1 + 2
    item = 6 * 3 * 4
    assert p.engine.bytes == 2 * LAYOUT.num_layers * 2 * LAYOUT.bytes_per_page_per_layer + p.args.aux.item_nbytes[0] + 2 * item


def test_a_decode_with_another_state_layout_fails_at_lookup(cluster: Cluster) -> None:
    pm, _ = cluster.prefill(state_side(width=3)[0])
    dm, _ = cluster.decode(state_side(width=4)[0])
    pm.create_sender(12)
    recv = dm.create_receiver(12, ADDR)
    assert until_terminal(recv)[0] is KVPoll.Failed
    assert "state_shapes" in (recv.failure_reason or ""), recv.failure_reason
    plain, _ = cluster.decode()  # an attention-only decode cannot take a hybrid prefill's rooms either
    recv = plain.create_receiver(13, ADDR)
    assert until_terminal(recv)[0] is KVPoll.Failed and "state" in (recv.failure_reason or "")


def test_a_room_is_bound_to_its_prompt_and_its_decode(cluster: Cluster) -> None:
    """Two requests that share a room id (a client-chosen bootstrap_room): the prefill writes the
    room's KV only to a decode that holds it for the same prompt, and only to the first one; the
    other decode's room fails with the reason, the bound pair completes untouched."""
    from transfer.messages import prompt_digest

    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    dm2, _ = cluster.decode()
    mine, theirs = prompt_digest([1, 2, 3]), prompt_digest([9, 9, 9])
    assert mine != theirs and mine == prompt_digest([1, 2, 3]) and len(mine) == 32
    sender = pm.create_sender(31, prompt_digest=mine)
    other = dm.create_receiver(31, ADDR)  # another user's request, same room, another prompt
    wait_for(lambda: other.poll() is KVPoll.WaitingForInput)
    other.init([4, 5], aux_slot=0, prompt_digest=theirs)
    assert until_terminal(other)[0] is KVPoll.Failed and "another request's" in (other.failure_reason or "")
    assert sender.poll() is KVPoll.Bootstrapping  # the prefill's own room is left alone
    recv = dm2.create_receiver(31, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([1, 2], aux_slot=0, prompt_digest=mine)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([3, 4], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success


def test_a_second_decode_for_a_bound_room_is_refused(cluster: Cluster) -> None:
    from transfer.messages import prompt_digest

    pm, _ = cluster.prefill()
    d1, _ = cluster.decode()
    d2, _ = cluster.decode()
    digest = prompt_digest([7, 7])
    sender = pm.create_sender(41, prompt_digest=digest)
    first, second = d1.create_receiver(41, ADDR), d2.create_receiver(41, ADDR)
    wait_for(lambda: first.poll() is KVPoll.WaitingForInput and second.poll() is KVPoll.WaitingForInput)
    first.init([1], aux_slot=0, prompt_digest=digest)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    second.init([2], aux_slot=0, prompt_digest=digest)
    assert until_terminal(second)[0] is KVPoll.Failed and "already bound" in (second.failure_reason or "")
    sender.send([5], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(first)[0] is KVPoll.Success


def test_a_transfer_info_that_came_first_is_checked_against_the_prompt_too(cluster: Cluster) -> None:
    from transfer.messages import prompt_digest

    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    early = dm.create_receiver(51, ADDR)
    wait_for(lambda: early.poll() is KVPoll.WaitingForInput)
    early.init([3], aux_slot=0, prompt_digest=prompt_digest([1]))
    wait_for(lambda: pm.tables()["orphans"] == [51])  # kept until the prefill's request arrives
    sender = pm.create_sender(51, prompt_digest=prompt_digest([2]))  # ... for another prompt
    assert until_terminal(early)[0] is KVPoll.Failed and "another request's" in (early.failure_reason or "")
    assert sender.poll() is KVPoll.Bootstrapping
    sender.abort("test over")
    until_terminal(sender)


def test_the_other_half_of_a_refused_shared_room_fails_at_once(cluster: Cluster) -> None:
    """A decode refused for a live room (another prompt's) pairs with a prefill request that may
    arrive once that room is done: it fails at once, not after the bootstrap timeout. Likewise a
    decode whose prefill request got 409 fails at once, not after the orphan expiry."""
    from transfer.messages import prompt_digest

    pm, _ = cluster.prefill()
    dm, _ = cluster.decode()
    dm2, _ = cluster.decode()
    a, b = prompt_digest([1, 1]), prompt_digest([2, 2])

    def serve(room: int) -> None:
        """The winner (prompt b) completes on dm2 and is released: no tombstone is left."""
        recv = dm2.create_receiver(room, ADDR)
        wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
        recv.init([3], aux_slot=0, prompt_digest=b)
        wait_for(lambda: winner.poll() is KVPoll.WaitingForInput)
        winner.send([4], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
        assert until_terminal(winner)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
        assert room not in pm.tables()["rooms"] and room not in pm.tables()["tombstones"]

    winner = pm.create_sender(61, prompt_digest=b)
    loser = dm.create_receiver(61, ADDR)
    wait_for(lambda: loser.poll() is KVPoll.WaitingForInput)
    loser.init([1], aux_slot=0, prompt_digest=a)
    assert until_terminal(loser)[0] is KVPoll.Failed and "another request's" in (loser.failure_reason or "")
    serve(61)
    late = pm.create_sender(61, prompt_digest=a)  # the loser's own prefill request, late
    st, took = until_terminal(late, timeout=3)
    assert st is KVPoll.Failed and "was refused here" in (late.failure_reason or ""), late.failure_reason
    assert took < CFG.bootstrap_timeout_s / 2, took

    winner = pm.create_sender(62, prompt_digest=b)
    with pytest.raises(TransferError):
        pm.create_sender(62, prompt_digest=a)  # 409 for the other request's prefill half
    serve(62)
    late_decode = dm.create_receiver(62, ADDR)  # that request's decode, once 62 is done
    wait_for(lambda: late_decode.poll() is KVPoll.WaitingForInput)
    t0 = time.monotonic()
    late_decode.init([2], aux_slot=0, prompt_digest=a)
    st, _ = until_terminal(late_decode, timeout=3)
    assert st is KVPoll.Failed and "was refused here" in (late_decode.failure_reason or ""), late_decode.failure_reason
    assert time.monotonic() - t0 < CFG.bootstrap_timeout_s / 2
    wait_for(lambda: not pm.tables()["refused"], timeout=3)  # forgotten after the bootstrap timeout
