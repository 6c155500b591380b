"""``decode_prefix_len`` between the two roles: the decode's TransferInfo names the prompt tokens
it already holds (its own prefix cache), the prefill still computes the whole prompt but hands
the sender only the pages past them, with a KV digest over exactly those pages; a bad value is
refused. Prefill scheduler on the stub harness of test_prefill_scheduler; the managers on the
fake data plane of test_transfer_fake_flow."""
from __future__ import annotations

from tests.unit.test_prefill_scheduler import Node, gen, prompt
from tests.unit.transfer_harness import ADDR, Cluster, cluster, until_terminal, wait_for  # noqa: F401
from transfer.aux import AuxRecord
from transfer.poll import KVPoll


def test_the_prefill_computes_everything_and_sends_only_the_pages_past_the_decode_prefix() -> None:
    node = Node(page_size=4, chunk=4)  # chunks of 4 tokens: the first two end inside the prefix
    ids = prompt(13)
    node.step(gen("a", ids, room=1))
    s = node.sender(1)
    s.state = KVPoll.WaitingForInput
    s.prefix_len = 8  # what the decode's TransferInfo said
    for _ in range(6):
        node.step()
    assert sum(len(c[1]) for call in node.engine.calls for c in call) == 13  # every token computed here
    kv_pages = [p for p in s.pages]
    assert len(kv_pages) == 2  # pages 2 and 3 of 4: tokens 8..12
    assert s.sent[-1][1] and s.sent[-1][2] is not None  # the last chunk carries the aux row
    assert all(pages for pages, last, _ in s.sent if not last)  # no empty intermediate chunks
    s.state = KVPoll.Success
    node.step()
    assert node.replies["a"].error is None
    node.assert_idle()


def test_a_decode_prefix_covering_the_whole_prompt_fails_the_request_cleanly() -> None:
    node = Node(page_size=4)
    node.step(gen("a", prompt(8), room=1))
    s = node.sender(1)
    s.state = KVPoll.WaitingForInput
    s.prefix_len = 8  # nothing left to send: a decode bug
    for _ in range(3):
        node.step()
        if "a" in node.replies:
            break
    s.state = KVPoll.Failed  # the abort reached the room
    for _ in range(3):
        node.step()
    assert node.replies["a"].http_status == 500 and "claims 8" in (node.replies["a"].error or "")
    node.assert_idle()


def test_decode_prefix_len_reaches_the_sender_and_only_suffix_pages_move(cluster: Cluster) -> None:  # noqa: F811
    pm, p = cluster.prefill()
    dm, _ = cluster.decode()
    sender = pm.create_sender(31)
    recv = dm.create_receiver(31, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([5, 6], aux_slot=0, decode_prefix_len=8)  # the decode holds 2 pages; 2 more to come
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    assert sender.decode_prefix_len == 8
    sender.send([3, 4], last_chunk=True, aux=AuxRecord(room=0, token_id=3, cached_tokens=0))
    assert until_terminal(sender)[0] is KVPoll.Success and until_terminal(recv)[0] is KVPoll.Success
    assert sender.decode_prefix_len == 8  # still answered once the table forgot the room
    assert p.engine.bytes == 2 * sum(p.args.kv.item_nbytes) + p.args.aux.item_nbytes[0]  # two pages + aux


def test_a_decode_prefix_that_is_not_whole_pages_is_refused(cluster: Cluster) -> None:  # noqa: F811
    pm, p = cluster.prefill()
    dm, _ = cluster.decode()
    sender = pm.create_sender(32)
    recv = dm.create_receiver(32, ADDR)
    wait_for(lambda: recv.poll() is KVPoll.WaitingForInput)
    recv.init([5], aux_slot=0, decode_prefix_len=3)
    state, _ = until_terminal(recv)
    assert state is KVPoll.Failed and "whole number" in (recv.failure_reason or "")
    assert sender.poll() is KVPoll.Bootstrapping and p.engine.bytes == 0  # nothing written
    sender.abort("test over")
    until_terminal(sender)
