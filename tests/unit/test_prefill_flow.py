"""PrefillScheduler, the requests that succeed: bootstrap, forward, transfer, release; chunked
prefill; prefix reuse; the token budget; the scheduling policy; KV capacity held by transfers;
local requests; flushing the cache (harness of test_prefill_scheduler).

Each scenario drives ``step`` and checks the replies, what was sent for each room (pages in order,
each once, aux on the last chunk), and ``check_integrity`` after every step.
"""
from __future__ import annotations

import pytest

from common.ipc.protocol import AbortReq
from common.sched.stop import StopChecker
from tests.unit.test_prefill_scheduler import Node, gen, prompt, token_for
from transfer.aux import AuxRecord
from transfer.poll import KVPoll


# ---- the happy path --------------------------------------------------------------------------


def test_bootstrap_forward_transfer_release() -> None:
    node = Node(page_size=4)
    ids = prompt(10)
    assert node.step(gen("a", ids, room=7, return_logprob=True, top_logprobs_num=2)) == []
    assert node.engine.calls == [], "no forward before the decode said where to write"
    assert node.stats.load() == {"num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 0}
    node.ready(7)
    assert node.step() == []
    s = node.sender(7)
    kv = node.sched.queues.inflight[0].kv
    assert kv is not None and len(kv.pages) == 3
    assert s.sent == [(kv.pages, True, AuxRecord(room=7, token_id=token_for(ids), cached_tokens=0, logprob=-0.25,
                                                 top_ids=(token_for(ids), token_for(ids) + 1), top_logprobs=(-0.25, -1.5)))]
    assert node.engine.calls == [[(kv.row, ids, 0, True)]]
    assert node.step() == [], "no reply before the transfer finished"
    assert node.stats.memory()["transfer_pages"] == 3
    s.state = KVPoll.Success
    (out,) = node.step()
    assert out.rid == "a" and out.finish is not None and out.finish.to_json() == {"type": "length", "length": 0}
    assert out.error is None and out.prompt_tokens == 10 and out.new_token_ids == []
    node.assert_idle()
    assert node.stats.memory()["cached_pages"] == 2  # the two full prompt pages stay for reuse


@pytest.mark.parametrize("page_size,chunk,length", [(4, 4, 10), (4, 6, 14), (1, 3, 7), (16, 5, 40), (4, 8, 16)])
def test_chunked_prefill_sends_each_page_once_in_order(page_size: int, chunk: int, length: int) -> None:
    node = Node(page_size=page_size, chunk=chunk)
    ids = prompt(length)
    node.step(gen("a", ids, room=1))
    node.ready(1)
    steps = 0
    while node.sched.queues.chunked is not None or steps == 0:
        node.step()
        steps += 1
        s = node.sender(1)
        req = node.sched.queues.chunked or node.sched.queues.inflight[0]
        assert req.kv is not None
        # everything sent so far is whole pages of computed tokens (the partial page waits)
        if node.sched.queues.chunked is not None:
            assert len(s.pages) == req.kv.kv_len // page_size
    assert steps == -(-length // chunk)
    s = node.sender(1)
    kv = node.sched.queues.inflight[0].kv
    assert kv is not None
    assert s.pages == kv.pages and len(kv.pages) == -(-length // page_size)
    assert [last for _, last, _ in s.sent] == [False] * (len(s.sent) - 1) + [True]
    assert all(aux is None for _, _, aux in s.sent[:-1]) and s.sent[-1][2] is not None
    calls = [c for call in node.engine.calls for c in call]
    assert [c[2] for c in calls] == list(range(0, length, chunk))  # prefix lengths
    assert sum((c[1] for c in calls), []) == ids
    assert [c[3] for c in calls] == [False] * (len(calls) - 1) + [True]  # sampled on the last chunk only
    s.state = KVPoll.Success
    node.step()
    node.assert_idle()


def test_a_short_prompt_joins_the_chunked_requests_slice_and_finishes_first() -> None:
    """A prompt arriving while a long one is part-way runs in the long one's next slice when it
    fits whole; the long one stays the chunked request, every page of both is sent once, and a
    prompt that would have to be cut waits for the long one to finish."""
    node = Node(page_size=4, chunk=8, max_tokens=16)
    long, short, big = prompt(24), prompt(5, base=100), prompt(12, base=200)
    node.step(gen("long", long, room=1), gen("short", short, room=2), gen("big", big, room=3))
    node.ready(1)
    node.step()  # long[0:8]; the other two wait for their decodes
    node.ready(2, 3)
    node.step()  # long[8:16] + short (whole); big (12 > the chunk of 8) would be cut: it waits
    rows = {req.rid: req.kv.row for req in (node.sched.queues.chunked, *node.sched.queues.inflight)}  # type: ignore[union-attr]
    assert node.engine.calls[1] == [(rows["long"], long[8:16], 8, False), (rows["short"], short, 0, True)]
    assert node.sched.queues.chunked is not None and node.sched.queues.chunked.rid == "long"
    assert [r.rid for r in node.sched.queues.inflight] == ["short"] and node.sender(2).sent[-1][1]
    node.step()  # long[16:24] ends; big is new and gets the rest of the token budget: cut to 8
    assert [c[1] for c in node.engine.calls[2]] == [long[16:24], big[:8]]
    node.step()
    assert [c[1] for c in node.engine.calls[3]] == [big[8:]]
    for room, ids in ((1, long), (2, short), (3, big)):
        s = node.sender(room)
        assert len(s.pages) == len(set(s.pages)) == -(-len(ids) // 4) and s.sent[-1][1]
        s.state = KVPoll.Success
    node.step()
    node.assert_idle()


def test_a_short_prompt_overtakes_one_that_must_wait_for_the_chunked_request() -> None:
    """A prompt that would be cut cannot start while another is chunked, so one behind it that
    fits whole runs in the long one's next slice instead of waiting behind both; the overtaken
    prompt keeps its place and starts the step the long one ends."""
    node = Node(page_size=4, chunk=8, max_tokens=16)
    long, big, short = prompt(24), prompt(12, base=200), prompt(5, base=100)
    node.step(gen("long", long, room=1), gen("big", big, room=2), gen("short", short, room=3))
    node.ready(1)
    node.step()  # long[0:8]
    node.ready(2, 3)
    node.step()  # long[8:16] + short (whole), although big arrived first
    rows = {req.rid: req.kv.row for req in (node.sched.queues.chunked, *node.sched.queues.inflight)}  # type: ignore[union-attr]
    assert node.engine.calls[1] == [(rows["long"], long[8:16], 8, False), (rows["short"], short, 0, True)]
    assert [r.rid for r in node.sched.queues.waiting] == ["big"]
    node.step()  # long ends; big is first again and gets the rest of the budget
    assert [c[1] for c in node.engine.calls[2]] == [long[16:24], big[:8]]
    node.step()
    assert [c[1] for c in node.engine.calls[3]] == [big[8:]]
    for room, ids in ((1, long), (2, big), (3, short)):
        s = node.sender(room)
        assert len(s.pages) == len(set(s.pages)) == -(-len(ids) // 4) and s.sent[-1][1]
        s.state = KVPoll.Success
    node.step()
    node.assert_idle()


def test_second_request_reuses_the_cached_prefix_and_sends_those_pages_too() -> None:
    node = Node(page_size=4)
    a = prompt(12)
    node.step(gen("a", a, room=1))
    node.ready(1)
    node.step()
    cached_pages = node.sched.queues.inflight[0].kv.pages[:2]  # type: ignore[union-attr]
    node.sender(1).state = KVPoll.Success
    node.step()
    b = a[:8] + prompt(5, base=50)
    node.step(gen("b", b, room=2))
    node.ready(2)
    node.step()
    req = node.sched.queues.inflight[0]
    assert req.kv is not None and req.kv.num_cached == 8
    mem = node.stats.memory()  # the 2 cached pages are the cache's, not also the request's
    assert mem["held_pages"] == len(req.kv.pages) - 2 == mem["transfer_pages"]
    assert mem["free_pages"] + mem["cached_pages"] + mem["held_pages"] == mem["total_pages"]
    assert node.engine.calls[-1] == [(req.kv.row, b[8:], 8, True)]  # only the new tokens run
    s = node.sender(2)
    assert s.pages[:2] == cached_pages and s.pages == req.kv.pages
    assert s.sent[-1][2] is not None and s.sent[-1][2].cached_tokens == 8
    s.state = KVPoll.Success
    (out,) = node.step()
    assert out.cached_tokens == 8
    node.assert_idle()
    assert node.sched.counters.cached_tokens == 8


def test_token_budget_splits_batches() -> None:
    node = Node(max_tokens=16)
    node.step(*(gen(f"r{i}", prompt(8, base=10 * i), room=i) for i in range(3)))
    node.ready(0, 1, 2)
    node.step()
    assert [len(c[1]) for c in node.engine.calls[0]] == [8, 8]
    node.step()
    assert [len(c[1]) for c in node.engine.calls[1]] == [8]
    for i in range(3):
        node.sender(i).state = KVPoll.Success
    node.step()
    node.assert_idle()


@pytest.mark.parametrize("policy,first", [("fcfs", "x"), ("lpm", "y")])
def test_policy_order(policy: str, first: str) -> None:
    node = Node(page_size=4, max_tokens=12, policy=policy)
    hot = prompt(12, base=70)
    node.step(gen("warm", hot, room=1))
    node.ready(1)
    node.step()
    node.sender(1).state = KVPoll.Success
    node.step()
    x, y = prompt(11, base=5), hot[:8] + prompt(4, base=33)
    node.step(gen("x", x, room=2), gen("y", y, room=3))
    node.ready(2, 3)
    node.step()  # the budget takes one of them (11 new tokens for x, 4 for y; y then x would be 15)
    ran = node.engine.calls[-1][0][1]
    assert ran == (x if first == "x" else y[8:])


def test_kv_capacity_counts_pages_held_by_transfers() -> None:
    node = Node(page_size=4, pages=6)
    node.step(gen("a", prompt(16), room=1))
    node.ready(1)
    node.step()  # a holds 4 of 6 pages while its transfer runs
    node.step(gen("b", prompt(12, base=40), room=2))
    node.ready(2)
    node.step()
    assert len(node.engine.calls) == 1, "b needs 3 pages, only 2 are free"
    assert [r.rid for r in node.sched.queues.waiting] == ["b"]
    assert not node.sched.runnable(), "nothing fits: the loop may wait instead of spinning"
    node.sender(1).state = KVPoll.Success
    node.step()  # a releases (4 full pages cached, evictable); b fits by evicting one
    assert len(node.engine.calls) == 2
    assert node.memory.cache.total_pages() == 3, "a cached its 4 full pages; b needed one of them evicted"
    node.sender(2).state = KVPoll.Success
    node.step()
    node.assert_idle()


# ---- computing ahead of the decode's answer ------------------------------------------------


def test_a_prompt_computed_ahead_waits_parked_then_sends_it_all_once() -> None:
    node = Node(page_size=4, ahead_pages=8)
    ids = prompt(10)
    node.step(gen("a", ids, room=1))
    q, s = node.sched.queues, node.sender(1)
    assert [r.rid for r in q.parked] == ["a"] and s.sent == [], "computed, but nowhere to write yet"
    kv = q.parked[0].kv
    assert kv is not None and node.engine.calls == [[(kv.row, ids, 0, True)]]
    assert node.stats.memory()["parked_reqs"] == 1 and node.stats.metrics()["num_running_reqs"] == 1.0
    node.now += 0.5
    assert node.step() == [] and s.sent == [], "the decode has not answered"
    s.prefix_len = 4  # the decode's own cache holds the first page
    node.ready(1)
    node.step()
    assert s.sent == [(kv.pages[1:], True, AuxRecord(room=1, token_id=token_for(ids), cached_tokens=0, logprob=0.0,
                                                     top_ids=(), top_logprobs=()))]
    assert [r.rid for r in q.inflight] == ["a"] and not q.parked
    assert len(node.engine.calls) == 1, "computed once"
    s.state = KVPoll.Success
    (out,) = node.step()
    assert out.error is None and out.timeline is not None
    st = out.timeline.stages
    assert list(st) == ["bootstrap", "queue", "forward", "transfer"], "the stages' order, whatever came first"
    node.assert_idle()


@pytest.mark.parametrize("length,chunk,ready_after", [(14, 4, 2), (14, 4, 0), (16, 8, 1), (7, 3, 3)])
def test_chunks_computed_ahead_go_out_with_the_first_chunk_after_the_answer(length: int, chunk: int,
                                                                            ready_after: int) -> None:
    """Chunks computed before the decode answered wait in their pages; the first send after the
    answer carries all of them, and every page goes exactly once, in order."""
    node = Node(page_size=4, chunk=chunk, ahead_pages=16)
    node.step(gen("a", prompt(length), room=1))
    s = node.sender(1)
    for _ in range(ready_after):
        node.step()
    assert s.sent == []
    node.ready(1)
    for _ in range(10):
        if not node.sched.queues.chunked and not node.sched.queues.parked:
            break
        node.step()
    (req,) = node.sched.queues.inflight
    assert req.kv is not None and s.pages == req.kv.pages and s.sent[-1][1] and s.sent[-1][2] is not None
    assert len(node.engine.calls) == -(-length // chunk), "every chunk computed once"
    s.state = KVPoll.Success
    node.step()
    node.assert_idle()


def test_computing_ahead_keeps_within_its_pages_and_after_the_answered_prompts() -> None:
    node = Node(page_size=4, ahead_pages=6, max_tokens=20)
    node.step(gen("a", prompt(10, base=1), room=1), gen("b", prompt(10, base=2), room=2),
              gen("c", prompt(10, base=3), room=3))
    q = node.sched.queues
    assert [r.rid for r in q.parked] == ["a", "b"] and [r.rid for r in q.bootstrap] == ["c"], "3 + 3 pages, not 9"
    node.step()
    assert [r.rid for r in q.bootstrap] == ["c"] and len(node.engine.calls) == 1, "the cap holds on later steps"
    node.ready(1)
    node.step()  # a is sent: its pages no longer count against the cap
    assert [r.rid for r in q.parked] == ["b", "c"] and len(node.engine.calls) == 2
    # An answered prompt goes before one computed ahead: the budget (20 tokens) fits two of 10.
    node.step(gen("d", prompt(10, base=4), room=4), gen("e", prompt(10, base=5), room=5),
              gen("f", prompt(10, base=6), room=6))
    node.ready(2, 3)  # b and c leave parked, so the cap has room for two again
    node.step()
    assert [r.rid for r in q.bootstrap] == ["f"] and {r.rid for r in q.parked} == {"d", "e"}
    node.ready(6)
    node.step(gen("g", prompt(10, base=7), room=7))
    assert [c[0][1] for c in node.engine.calls[-1:]] == [prompt(10, base=6)], "f (answered) before g (ahead)"
    for room in range(1, 8):
        if node.sender(room).state is KVPoll.Bootstrapping:
            node.ready(room)
    for _ in range(6):
        node.step()
        for room in range(1, 8):
            if node.sender(room).state is KVPoll.Transferring:
                node.sender(room).state = KVPoll.Success
    node.step()
    assert set(node.replies) == set("abcdefg") and all(o.error is None for o in node.replies.values())
    node.assert_idle()


@pytest.mark.parametrize("how", ["fail", "abort"])
def test_a_parked_prompt_whose_room_ends_is_released_once(how: str) -> None:
    node = Node(page_size=4, ahead_pages=8)
    node.step(gen("a", prompt(10), room=1))
    assert node.sched.queues.parked
    if how == "fail":
        node.sender(1).fail("decode gave up")
        (out,) = node.step()
        assert out.http_status == 503 and out.error is not None and "decode gave up" in out.error
    else:
        (out,) = node.step(AbortReq(rid="a"))
        assert out.finish is not None and out.finish.type == "abort" and out.http_status is None
    assert node.sender(1).sent == []
    node.assert_idle()
    assert node.stats.memory()["cached_pages"] == 2, "its computed full pages still serve later prompts"


# ---- local requests, flushing the cache -----------------------------------------------------


def test_local_request_answers_the_first_token() -> None:
    node = Node()
    ids = prompt(5)
    (out,) = node.step(gen("h", ids, room=None, max_new=1))  # answered in the step it arrives
    assert out.new_token_ids == [token_for(ids)] and out.finish is not None and out.finish.type == "length"
    node.assert_idle()


def test_local_request_stops_on_eos() -> None:
    node = Node()
    ids = [49, 50, 0]  # the stub engine samples sum % 50 == 49
    node.sched.stop = StopChecker([49])
    (out,) = node.step(gen("h", ids, room=None, max_new=1))  # answered in the step it arrives
    assert out.finish is not None and out.finish.to_json() == {"type": "stop", "matched": 49}


def test_flush_cache_only_when_idle() -> None:
    node = Node()
    node.step(gen("a", prompt(9), room=1))
    assert node.stats.flush_cache()[0] is False
    node.ready(1)
    node.step()
    node.sender(1).state = KVPoll.Success
    node.step()
    assert node.stats.memory()["cached_pages"] == 2
    assert node.stats.flush_cache() == (True, "prefix cache flushed")
    assert node.stats.memory()["cached_pages"] == 0
    node.assert_idle()
