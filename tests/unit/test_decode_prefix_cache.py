"""The decode's own prefix cache (``--disaggregation-decode-enable-radix-cache``): a finished
request's whole pages (prompt + output) stay cached; the next turn of the conversation locks its
longest cached prefix in prealloc, tells the prefill ``decode_prefix_len`` and receives only the
pages past it. Fake engine and transfer as in test_decode_scheduler: the engine asserts that the
KV it reads through the row is prompt + output, so a reused page holding anything else, or a
page freed while still cached or locked, fails; expected tokens come from ``reference()``."""
from __future__ import annotations

from common.timeline import LOCAL_DECODE_STAGES
from tests.unit.test_decode_scheduler import PS, Rig, next_token, prompt_of, reference


def _turn(rig: Rig, rid: str, prompt: list[int], max_new: int, room: int) -> list[int]:
    rig.add(rid, prompt, max_new, room=room)
    rig.run()
    out = rig.tokens(rid)
    assert out == reference(prompt, max_new), rid
    return out


def test_second_turn_receives_only_the_pages_past_the_cached_conversation() -> None:
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(1, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    assert rig.hub.rx[1].prefix_len == 0 and len(rig.hub.rx[1].pages or []) == 3  # nothing cached yet
    # Turn 1 wrote KV for p1 + o1[:-1] (17 tokens): 4 whole pages stay cached, the tail page is freed.
    assert rig.memory.cache.total_pages() == 4
    p2 = p1 + o1 + [5, 6, 7, 8, 9]  # 23 tokens: the previous prompt, its answer, new user text
    _turn(rig, "t2", p2, 6, room=2)
    rx = rig.hub.rx[2]
    assert rx.prefix_len == 16  # whole pages only
    assert len(rx.pages or []) == -(-len(p2) // PS) - 4  # only the pages past the reused prefix
    c = rig.sched.counters
    assert (c.transferred_tokens, c.reused_tokens) == (10 + len(p2) - 16, 16)
    m = rig.stats.metrics()
    assert m["pdc_decode_transferred_tokens_total"] == 10 + len(p2) - 16 and m["pdc_decode_reused_tokens_total"] == 16
    assert rig.final("t2").cached_tokens == 3  # the prefill's own hit (aux) is what meta_info reports
    # Per request, beside it: this node's own hit (0 on the first turn, whose KV all arrived).
    assert (rig.final("t1").decode_reused_tokens, rig.final("t2").decode_reused_tokens) == (0, 16)
    rig.assert_clean()


def test_every_streamed_output_reports_the_decode_reuse_and_a_local_request_what_it_computed() -> None:
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(11, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    p2 = p1 + o1 + [4, 4]
    rig.add("t2", p2, 5, room=2, stream=True)
    rig.run()
    assert rig.tokens("t2") == reference(p2, 5)
    outs = rig.outputs["t2"]
    assert len(outs) > 1 and all(o.decode_reused_tokens == 16 for o in outs)  # from the first token on
    rig.add("local", prompt_of(12, 6), 3)  # no room, nothing cached: all six computed here
    rig.run()
    assert (rig.final("local").decode_reused_tokens, rig.final("local").decode_computed_tokens) == (0, 6)
    assert rig.final("t2").decode_computed_tokens is None  # its KV came from the prefill
    rig.assert_clean()


def test_a_local_next_turn_computes_only_what_its_cached_conversation_lacks() -> None:
    """The router's --decode-local-prefill-tokens: turn 2 comes without a room to the decode that
    ran turn 1; it locks the cached conversation and computes only the tokens past it."""
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(13, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)  # caches 16 tokens (4 pages): p1 + o1[:6]
    p2 = p1 + o1 + [5, 6, 7, 8, 9]  # 23 tokens
    before = rig.engine.extend_tokens
    rig.add("t2", p2, 6, stream=True)
    rig.run()
    assert rig.tokens("t2") == reference(p2, 6)  # the fake engine reads the whole prefix through the row
    assert rig.engine.extend_tokens - before == len(p2) - 16
    assert 2 not in rig.hub.rx and len(rig.hub.rx) == 1  # no room: nothing was received
    outs = rig.outputs["t2"]
    assert all((o.cached_tokens, o.decode_reused_tokens, o.decode_computed_tokens) == (16, 16, len(p2) - 16)
               for o in outs)
    c = rig.sched.counters
    assert (c.reused_tokens, c.local_prefill_tokens, c.transferred_tokens) == (16, len(p2) - 16, 10)
    m = rig.stats.metrics()
    assert m["pdc_decode_local_prefill_tokens_total"] == len(p2) - 16 and m["pdc_decode_reused_tokens_total"] == 16
    timeline = rig.final("t2").timeline
    assert timeline is not None and tuple(timeline.stages) == LOCAL_DECODE_STAGES and timeline.forwards == 5
    # Its own pages joined the cache: turn 3, routed the same way, reuses turn 2's answer too.
    o2 = rig.tokens("t2")
    p3 = p2 + o2 + [1, 1]
    rig.add("t3", p3, 4)
    rig.run()
    assert rig.tokens("t3") == reference(p3, 4)
    assert rig.final("t3").decode_reused_tokens == (len(p2) + len(o2) - 1) // PS * PS
    rig.assert_clean()


def test_a_fully_cached_page_aligned_prompt_still_leaves_its_last_page_to_the_prefill() -> None:
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(2, 16)
    _turn(rig, "t1", p1, 5, room=1)  # caches 20 tokens' pages (5 pages)
    _turn(rig, "again", p1, 4, room=2)  # the same 16-token prompt
    rx = rig.hub.rx[2]
    assert rx.prefix_len == 12 and len(rx.pages or []) == 1  # at least one token comes from the prefill
    rig.assert_clean()


def test_off_by_default_nothing_is_cached_and_every_page_is_sent() -> None:
    rig = Rig()
    p1 = prompt_of(3, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    _turn(rig, "t2", p1 + o1 + [1, 2], 3, room=2)
    assert rig.hub.rx[2].prefix_len == 0 and rig.memory.cache.total_pages() == 0
    assert rig.sched.counters.reused_tokens == 0 and rig.final("t2").decode_reused_tokens == 0
    rig.assert_clean()


def test_cached_pages_are_evicted_before_a_room_is_refused() -> None:
    rig = Rig(pages=12, reserved=2, prefix_cache=True)
    for i in range(4):  # fill the cache with unrelated conversations
        _turn(rig, f"fill{i}", prompt_of(10 + i, 9), 4, room=10 + i)
    assert rig.memory.allocator.num_free < 8 and rig.memory.cache.evictable_pages() > 0
    _turn(rig, "big", prompt_of(20, 30), 4, room=20)  # needs 8 pages + headroom: only after eviction
    rig.assert_clean()


def test_abort_and_failure_unlock_the_prefix_once_and_keep_it_cached() -> None:
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(4, 12)
    o1 = _turn(rig, "t1", p1, 6, room=1)
    cached = rig.memory.cache.total_pages()
    p2 = p1 + o1 + [3, 3, 3]
    rig.add("aborted", p2, 5, room=2)
    rig.step(complete=False)
    assert rig.hub.rx[2].prefix_len > 0 and rig.memory.cache.protected_pages() > 0  # locked while in use
    rig.abort("aborted")
    rig.step(complete=False)
    rig.hub.fail(2, "prefill answered the abort")  # the room ends: its own pages are freed
    rig.step(complete=False)
    assert rig.final("aborted").finish.type == "abort"  # type: ignore[union-attr]
    assert rig.memory.cache.protected_pages() == 0 and rig.memory.cache.total_pages() == cached
    rig.add("failed", p2, 5, room=3)
    rig.step(complete=False)
    rig.hub.fail(3, "prefill rank 0: boom")
    rig.step(complete=False)
    assert rig.final("failed").http_status == 503
    assert rig.memory.cache.protected_pages() == 0 and rig.memory.cache.total_pages() == cached
    _turn(rig, "ok", p2, 5, room=4)  # the prefix is still good
    assert rig.hub.rx[4].prefix_len == rig.hub.rx[2].prefix_len
    rig.assert_clean()


def test_retraction_releases_the_locked_prefix_once_and_recomputes_exactly() -> None:
    rig = Rig(pages=14, reserved=1, ratio_init=0.0, prefix_cache=True)
    p1 = prompt_of(5, 9)
    o1 = _turn(rig, "t1", p1, 4, room=1)
    p2 = p1 + o1 + [1, 2, 3]
    for i, (rid, prompt) in enumerate([("conv", p2), ("x", prompt_of(6, 9)), ("y", prompt_of(7, 9))]):
        rig.add(rid, prompt, 20, room=10 + i)
    rig.run()
    assert rig.sched.counters.retractions > 0, "the pool was meant to run dry"
    assert rig.hub.rx[10].prefix_len > 0
    for rid, prompt in [("conv", p2), ("x", prompt_of(6, 9)), ("y", prompt_of(7, 9))]:
        assert rig.tokens(rid) == reference(prompt, 20), rid
    rig.assert_clean()


def test_flush_cache_empties_the_decode_cache_only_when_idle() -> None:
    rig = Rig(prefix_cache=True)
    p1 = prompt_of(8, 10)
    _turn(rig, "t1", p1, 8, room=1)
    assert rig.memory.cache.total_pages() > 0
    rig.add("busy", prompt_of(9, 5), 30, room=2)
    rig.step()
    ok, why = rig.stats.flush_cache()
    assert not ok and "in flight" in why
    rig.run()
    ok, why = rig.stats.flush_cache()
    assert ok and rig.memory.cache.total_pages() == 0
    m = rig.stats.memory()
    assert m["free_pages"] == m["total_pages"]
    _turn(rig, "after", p1 + [next_token(p1)], 3, room=3)  # nothing left to reuse
    assert rig.hub.rx[3].prefix_len == 0
    rig.assert_clean()


# ---- KV integrity with reuse: the arrival check covers what arrived, reuse checks the cache ------


def _rig_with_digests() -> tuple[Rig, object]:
    """The decode rig with a real pool beside it: rooms "arrive" as bytes there, with the digest
    the prefill computes over the pages it sends (those past ``decode_prefix_len``)."""
    from common.kvcache.page_digest import PageDigests
    from tests.unit.test_kv_integrity import KEY, fill, pool
    from transfer.aux import AuxRecord

    rig = Rig(prefix_cache=True)
    p = pool(num_pages=rig.memory.allocator.num_total + 1)
    rig.memory.digests = PageDigests(p.buffers(), PS, p.num_pages, KEY)
    prefill = PageDigests(p.buffers(), PS, p.num_pages, KEY)  # the prefill's view of the bytes it sends
    complete = rig.hub.complete

    def complete_with_digest(room: int, logprob: float = -0.5) -> None:
        complete(room, logprob)
        r = rig.hub.rx[room]
        assert r.pages is not None and r.slot is not None
        n = len(rig.prompts[room]) - r.prefix_len  # tokens sent
        fill(p, r.pages, seed=room)
        prefill.record(r.pages[:-1])
        prefill.record(r.pages[-1:], valid_last=n - (len(r.pages) - 1) * PS)
        rig.aux.write(r.slot, AuxRecord(room=room, token_id=next_token(rig.prompts[room]), cached_tokens=0,
                                        kv_digest=prefill.room_digest(r.pages, n)))

    rig.hub.complete = complete_with_digest  # type: ignore[method-assign]
    return rig, p


def test_with_digests_a_reused_prefix_passes_and_only_the_arrived_pages_are_checked() -> None:
    rig, _ = _rig_with_digests()
    p1 = prompt_of(11, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    p2 = p1 + o1 + [4, 4, 4]
    _turn(rig, "t2", p2, 5, room=2)
    assert rig.hub.rx[2].prefix_len == 16
    assert rig.memory.digests is not None and rig.memory.digests.failures == 0
    rig.assert_clean()


def test_a_cached_page_written_over_is_not_reused_the_prefill_sends_from_there() -> None:
    from tests.unit.test_kv_integrity import poke

    rig, p = _rig_with_digests()
    p1 = prompt_of(12, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    cached = rig.memory.cache.match_prefix(p1 + o1, max_tokens=16).pages
    assert len(cached) == 4
    poke(p, cached[2], layer_buffer=1)  # a write through the data plane into a cached page
    p2 = p1 + o1 + [4, 4, 4]
    _turn(rig, "t2", p2, 5, room=2)  # exact all the same: pages 2.. come from the prefill
    assert rig.hub.rx[2].prefix_len == 2 * PS
    assert rig.memory.digests is not None and rig.memory.digests.failures == 1
    rig.assert_clean()


def test_a_local_request_does_not_reuse_a_cached_page_written_over_and_recomputes_from_it() -> None:
    from tests.unit.test_kv_integrity import poke

    rig, p = _rig_with_digests()
    p1 = prompt_of(13, 10)
    o1 = _turn(rig, "t1", p1, 8, room=1)
    cached = rig.memory.cache.match_prefix(p1 + o1, max_tokens=16).pages
    poke(p, cached[2], layer_buffer=0)
    p2 = p1 + o1 + [2, 2, 2]
    rig.add("t2", p2, 5)  # local: no room
    rig.run()
    assert rig.tokens("t2") == reference(p2, 5)
    assert (rig.final("t2").decode_reused_tokens, rig.final("t2").decode_computed_tokens) == (2 * PS, len(p2) - 2 * PS)
    assert rig.memory.digests is not None and rig.memory.digests.failures == 1
    rig.assert_clean()
