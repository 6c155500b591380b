"""Decode scheduler: rooms admitted by memory (held in prealloc until pages free), forced
retraction and resume by recompute, the new-token ratio, and the load and metrics reports
(fake engine and transfer, as in test_decode_scheduler)."""
from __future__ import annotations

import pytest

from tests.unit.test_decode_scheduler import PS, Rig, prompt_of, reference


def test_memory_checks_hold_rooms_in_prealloc_until_pages_free() -> None:
    # 12 pages; each room needs 3 prompt pages, and its worst case 3 + 8 = 11 pages.
    rig = Rig(pages=12, reserved=4)
    for i in range(3):
        rig.add(f"m{i}", prompt_of(i, 12), 32, room=i)
    rig.step(complete=False)
    inited = [room for room, r in rig.hub.rx.items() if r.pages is not None]
    assert inited == [0]  # worst case of a second room does not fit beside the first's headroom
    rig.run()
    for i in range(3):
        assert rig.tokens(f"m{i}") == reference(prompt_of(i, 12), 32)
    rig.assert_clean()


def test_forced_retraction_still_gives_reference_tokens() -> None:
    # A tiny pool and a relaxed ratio: admission is optimistic, the pool runs dry, requests retract
    # and resume by recompute (the fake engine checks the recomputed KV token by token).
    rig = Rig(pages=24, rows=16, reserved=1, ratio_init=0.05)
    cases = {f"q{i}": (prompt_of(i, 5 + i), 28) for i in range(6)}
    for i, (rid, (prompt, n)) in enumerate(cases.items()):
        rig.add(rid, prompt, n, room=i, stream=i % 2 == 0)
    rig.run()
    assert rig.sched.counters.retractions > 0
    assert rig.sched.ratio.value > 0.05  # a retraction makes the ratio conservative again
    for rid, (prompt, n) in cases.items():
        assert rig.tokens(rid) == reference(prompt, n), rid
    rig.assert_clean()


def test_retracted_requests_resume_before_new_rooms() -> None:
    rig = Rig(pages=24, reserved=1, ratio_init=0.05)
    for i in range(5):
        rig.add(f"q{i}", prompt_of(i, 8), 30, room=i)
    for _ in range(200):
        rig.step()
        if rig.sched.queues.retracted:
            break
    assert rig.sched.queues.retracted
    rig.add("late", prompt_of(9, 4), 2, room=99)
    rig.step()  # takes "late": its receiver is ready at once, its pages must wait
    while rig.sched.queues.retracted:
        assert rig.hub.rx[99].pages is None, "a new room got pages while a retracted request waited"
        rig.step()
    rig.run()
    assert rig.tokens("late") == reference(prompt_of(9, 4), 2)
    rig.assert_clean()


def test_new_token_ratio_decays_per_decode_step_and_resets_when_idle() -> None:
    rig = Rig()
    r0 = rig.sched.ratio.value
    rig.add("a", prompt_of(1, 4), 10, room=1)
    rig.run()
    steps = len(rig.engine.decode_batches)
    assert steps == 9
    assert rig.sched.ratio.value == pytest.approx(r0 - steps * rig.sched.ratio.decay)
    rig.step()  # idle
    assert rig.sched.ratio.value == r0


def test_load_and_metrics_report_queues() -> None:
    rig = Rig(max_running=1)
    rig.add("r", prompt_of(3, 4), 30, room=3)
    rig.step()
    rig.step()  # "r" occupies the only running slot
    rig.hub.auto_handshake = False
    rig.add("a", prompt_of(1, 4), 10, room=1)  # stays in prealloc: its prefill never answers
    rig.add("b", prompt_of(2, 4), 10)  # local: waits in retracted for the running slot
    rig.step(complete=False)
    [running] = rig.sched.queues.running
    assert running.rid == "r" and running.kv is not None
    load = rig.stats.load()
    assert load == {"num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": len(running.kv.pages) * PS}
    met = rig.stats.metrics()
    assert met["num_running_reqs"] == 1 and met["num_waiting_reqs"] == 2
    assert met["num_prealloc_reqs"] == 1 and met["num_retracted_reqs"] == 1
    ok, _ = rig.stats.flush_cache()
    assert not ok
    rig.abort("a")
    rig.run()
    assert rig.stats.flush_cache()[0]
    rig.assert_clean()
