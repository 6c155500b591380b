"""Decode scheduler: a request that cannot run to its end (its transfer or handshake fails, its
room is refused on arrival, it is aborted in any stage, its room stays fenced, it outgrows the
whole pool, or the scheduler fails everything) is answered once and its memory released once
(fake engine and transfer, as in test_decode_scheduler)."""
from __future__ import annotations

import pytest

from tests.unit.test_decode_scheduler import PS, Rig, prompt_of, reference
from transfer.poll import KVPoll


def test_transfer_failure_is_a_503_naming_the_cause_and_frees_the_room() -> None:
    rig = Rig()
    rig.add("f", prompt_of(1, 9), 5, room=7)
    rig.step(complete=False)
    assert rig.memory.allocator.num_free < 64  # pages reserved for the room
    rig.hub.fail(7, "prefill rank 0: boom")
    rig.step(complete=False)
    fin = rig.final("f")
    assert fin.http_status == 503 and fin.error is not None and "boom" in fin.error and "room 7" in fin.error
    assert fin.finish is not None and fin.finish.type == "abort"
    rig.assert_clean()


def test_handshake_failure_before_any_page_is_a_503() -> None:
    rig = Rig()
    rig.hub.auto_handshake = False
    rig.add("h", prompt_of(1, 9), 5, room=7)
    rig.step()
    rig.hub.fail(7, "bootstrap 127.0.0.1:8998: connection refused")
    rig.step()
    assert rig.final("h").http_status == 503 and "connection refused" in (rig.final("h").error or "")
    rig.assert_clean()


def test_duplicate_room_and_oversized_prompt_are_rejected_with_400() -> None:
    rig = Rig(pages=8)
    rig.add("a", prompt_of(1, 5), 3, room=1)
    rig.add("b", prompt_of(2, 5), 3, room=1)
    rig.add("big", list(range(40)), 3, room=2)
    rig.step(complete=False)
    assert rig.final("b").http_status == 409 and "already in flight" in (rig.final("b").error or "")
    assert rig.final("big").http_status == 400 and "does not fit" in (rig.final("big").error or "")
    rig.run()
    assert rig.tokens("a") == reference(prompt_of(1, 5), 3)
    rig.assert_clean()


@pytest.mark.parametrize("stage", ["prealloc", "transfer", "waiting", "running", "retracted"])
def test_abort_in_every_stage_answers_once_and_releases_once(stage: str) -> None:
    rig = Rig(max_running=1)
    if stage in ("waiting", "retracted"):
        rig.add("busy", prompt_of(3, 4), 30, room=3)
        rig.step()
        rig.step()  # "busy" occupies the only running slot
    rig.hub.auto_handshake = stage != "prealloc"
    rig.add("x", prompt_of(1, 9), 30, room=1, stream=True)
    if stage == "retracted":
        rig.abort("x")
        rig.step(complete=False)
        rig.outputs.clear()
        rig.add("x", prompt_of(1, 9), 30)  # a local request waits in the retracted queue to be computed
    q = rig.sched.queues
    stage_queue = {"prealloc": q.prealloc, "transfer": q.transfer, "waiting": q.waiting, "running": q.running,
                   "retracted": q.retracted}[stage]
    for _ in range(3):
        if any(r.rid == "x" for r in stage_queue):
            break
        rig.step(complete=stage != "transfer")
    assert any(r.rid == "x" for r in stage_queue), stage
    rig.abort("x")
    rig.abort("x")  # a second abort is a no-op
    rig.step(complete=False)
    fin = rig.final("x").finish
    assert fin is not None and fin.type == "abort"
    if stage == "transfer":
        # The prefill may still write into the room's pages: they stay held until it answers.
        assert rig.sched.queues.draining and rig.memory.allocator.num_free < 64
        rig.hub.rx[1].status = KVPoll.Failed
    rig.abort("busy")
    rig.run()
    rig.assert_clean()


def test_fenced_room_is_answered_at_once_but_its_memory_held_until_the_fence_lifts() -> None:
    rig = Rig(pages=16)
    rig.add("x", prompt_of(1, 2 * PS), 4, room=1)  # 2 prompt pages
    rig.step(complete=False)
    assert rig.hub.rx[1].status is KVPoll.Transferring
    rig.hub.fail(1, "prefill hung past its bound")
    rig.hub.rx[1].held = True
    rig.step(complete=False)
    fin = rig.final("x")
    assert fin.finish is not None and fin.finish.type == "abort" and fin.http_status == 503
    m = rig.stats.memory()
    assert (m["fenced_reqs"], m["fenced_pages"]) == (1, 2) and m["free_pages"] == 14 and m["aux_free_slots"] == 15
    assert rig.stats.metrics()["fenced_reqs"] == 1 and not rig.sched.idle()
    # A room arriving now gets other pages: the fenced ones are never handed out.
    rig.add("y", prompt_of(2, 2 * PS), 3, room=2)
    for _ in range(20):
        rig.step()
        assert not set(rig.hub.rx[2].pages or []) & set(rig.hub.rx[1].pages or [])
        if rig.finished("y"):
            break
    assert rig.tokens("y") == reference(prompt_of(2, 2 * PS), 3)
    for _ in range(3):
        rig.step()  # still fenced: nothing freed, whatever the number of steps
    assert rig.stats.memory()["fenced_pages"] == 2 and rig.memory.allocator.num_free == 14
    rig.hub.rx[1].held = False  # the peer was proven unable to write
    rig.run()
    assert rig.stats.memory()["fenced_reqs"] == 0 and len([o for o in rig.outputs["x"] if o.finish]) == 1
    rig.assert_clean()


def test_a_request_outgrowing_the_whole_pool_fails_alone_and_cleanly() -> None:
    rig = Rig(pages=4, reserved=1)  # 16 tokens of KV in all
    rig.add("long", prompt_of(1, 6), 30, room=1, stream=True)
    rig.run()
    fin = rig.final("long")
    assert fin.http_status == 500 and "out of KV memory" in (fin.error or "")
    assert rig.tokens("long") == reference(prompt_of(1, 6), 30)[: len(rig.tokens("long"))]
    assert len(rig.tokens("long")) == 16 - 6 + 1  # every slot used: the last token needs none
    rig.assert_clean()


def test_fail_all_answers_every_request_with_500_and_fences_transfers() -> None:
    rig = Rig()
    rig.add("run", prompt_of(1, 5), 20, room=1)
    rig.step()
    rig.step()
    rig.add("xfer", prompt_of(2, 5), 20, room=2)
    rig.add("local", prompt_of(3, 5), 20)
    rig.step(complete=False)  # "xfer" gets its pages; nobody completes it
    assert [r.rid for r in rig.sched.queues.transfer] == ["xfer"]
    rig.record(rig.sched.fail_all("internal error in the decode scheduler: boom"))
    for rid in ("run", "xfer", "local"):
        assert rig.final(rid).http_status == 500 and "boom" in (rig.final(rid).error or "")
    assert rig.sched.queues.draining and rig.hub.rx[2].abort_pending is not None
    rig.hub.rx[2].status = KVPoll.Failed  # the prefill answers the abort
    rig.run()
    rig.assert_clean()
