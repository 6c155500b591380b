"""Decode memory policy on hand-computed numbers (page size 4)."""
from __future__ import annotations

import pytest

from common.config import ConfigError, SchedulerConfig
from decode_node.admission import DecodeBudget, DecodeBudgetConfig, Holder, NewTokenRatio


def budget(total: int = 100, reserved: int = 8) -> DecodeBudget:
    return DecodeBudget(DecodeBudgetConfig.from_sched(SchedulerConfig(reserved_decode_tokens=reserved), page_size=4,
                                                      total_pages=total))


def test_headroom_is_the_larger_of_reserve_and_ratio_share_capped_at_what_is_left() -> None:
    b = budget()
    assert b.headroom_tokens(100, 0.7) == 70
    assert b.headroom_tokens(100, 0.05) == 8  # at least the fixed reserve
    assert b.headroom_tokens(5, 0.7) == 5  # never more than the request can still generate
    assert b.headroom_pages(Holder(kv_len=10, steps_left=100, held_pages=3), 0.7) == 20 - 3


def test_allocatable_subtracts_headroom_or_single_request_need_and_comeback() -> None:
    b = budget()
    running = [Holder(kv_len=10, steps_left=100, held_pages=3)]
    queued = [Holder(kv_len=8, steps_left=4, held_pages=2)]
    retracted = [Holder(kv_len=6, steps_left=2, held_pages=0)]
    # headroom 17 + 1 = 18; single request: pages(110) - 3 = 25 wins; comeback pages(8) = 2
    assert b.allocatable_pages(50, running, queued, retracted, 0.7) == 50 - 25 - 2
    # with a low ratio the single-request term still dominates: 18 -> 3 + 1 = 4 < 25
    assert b.allocatable_pages(50, running, queued, [], 0.0) == 25


def test_immediate_need_check() -> None:
    b = budget()
    assert b.can_prealloc(20, 10, allocatable=23, retractable_pages=3, ratio=0.7)  # pages(20 + 8) = 7
    assert not b.can_prealloc(20, 200, allocatable=23, retractable_pages=3, ratio=0.7)  # pages(20 + 140) = 40
    assert not b.can_prealloc(20, 10, allocatable=6, retractable_pages=3, ratio=0.7)


def test_worst_case_check_counts_what_running_requests_could_give_back() -> None:
    b = budget()
    # immediate need pages(28) = 7 fits, but the worst case pages(20 + 199) = 55 minus 3 does not
    assert not b.can_prealloc(20, 200, allocatable=23, retractable_pages=3, ratio=0.0)
    # enough held by running requests to retract: 55 - 40 = 15 <= 23
    assert b.can_prealloc(20, 200, allocatable=23, retractable_pages=40, ratio=0.0)


def test_worst_case_is_capped_at_the_pool_so_an_idle_node_admits_long_requests() -> None:
    b = budget(total=10)
    assert b.can_prealloc(8, 1000, allocatable=10, retractable_pages=0, ratio=0.0)
    assert not b.can_prealloc(8, 1000, allocatable=9, retractable_pages=0, ratio=0.0)


def test_resume_needs_headroom_unless_alone() -> None:
    b = budget()
    h = Holder(kv_len=30, steps_left=50, held_pages=0)
    other = Holder(kv_len=8, steps_left=40, held_pages=2)
    # pages(30 + 35) = 17 for h; the other's headroom pages(8 + 28) - 2 = 7
    assert b.can_resume(h, free_pages=24, others=[other], ratio=0.7, alone=False)
    assert not b.can_resume(h, free_pages=23, others=[other], ratio=0.7, alone=False)
    assert b.can_resume(h, free_pages=8, others=[], ratio=0.7, alone=True)  # pages(31) = 8
    assert not b.can_resume(h, free_pages=7, others=[], ratio=0.7, alone=True)


def test_victims_fewest_outputs_first_then_longest_prompt_until_the_rest_fit() -> None:
    b = budget()
    a = Holder(kv_len=8, steps_left=20, held_pages=2, output_len=5, prompt_len=3)
    bb = Holder(kv_len=8, steps_left=20, held_pages=2, output_len=1, prompt_len=7)
    c = Holder(kv_len=8, steps_left=20, held_pages=2, output_len=1, prompt_len=4)
    # every request's last page is full: the next step needs 3 pages, 1 is free
    assert b.pick_victims([a, bb, c], free_pages=1) == ([1, 2], True)
    assert b.pick_victims([a, bb, c], free_pages=3) == ([], True)
    # the survivors must fit retract_decode_steps (20) steps, here 5 pages each: only one is left
    assert b.pick_victims([a, bb, c], free_pages=2) == ([1, 2], True)
    # requests near their end need little: one victim is enough (1 page each for their last 4 steps)
    short = [Holder(kv_len=8, steps_left=4, held_pages=2, output_len=o, prompt_len=p) for o, p in ((5, 3), (1, 7), (1, 4))]
    assert b.pick_victims(short, free_pages=1) == ([1], True)


def test_a_sole_request_that_cannot_grow_is_reported() -> None:
    b = budget()
    a = Holder(kv_len=8, steps_left=20, held_pages=2, output_len=5, prompt_len=3)
    assert b.pick_victims([a], free_pages=0) == ([], False)
    done = Holder(kv_len=8, steps_left=0, held_pages=2)
    assert b.pick_victims([done], free_pages=0) == ([], True)  # needs no page


def test_new_token_ratio_decays_to_floor_and_rises_after_retraction() -> None:
    r = NewTokenRatio(0.7, 0.1, 600)
    for _ in range(300):
        r.on_decode_step()
    assert r.value == pytest.approx(0.4)
    for _ in range(400):
        r.on_decode_step()
    assert r.value == pytest.approx(0.1)
    r.on_retract([Holder(kv_len=0, steps_left=30, held_pages=0, output_len=10)], steps=20)
    assert r.value == pytest.approx(30 / 41)
    r.on_retract([Holder(kv_len=0, steps_left=1000, held_pages=0, output_len=0)], steps=1)
    assert r.value == pytest.approx(30 / 41)  # never relaxes on a retraction
    r.reset()
    assert r.value == 0.7


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        DecodeBudgetConfig(page_size=4, total_pages=10, reserved_decode_tokens=8, ratio_init=0.1, ratio_min=0.5,
                           ratio_decay_steps=600)
    with pytest.raises(ValueError):
        DecodeBudgetConfig.from_sched(SchedulerConfig(), page_size=0, total_pages=10)
    with pytest.raises(ConfigError, match="--schedule-conservativeness"):  # the settings refuse it first
        SchedulerConfig(new_token_ratio_init=0.1, new_token_ratio_min=0.5).validate()


def test_immediate_need_is_capped_at_the_pool_too() -> None:
    b = budget(total=4)
    # headroom 21 tokens would ask for pages(6 + 21) = 7 > 4 pages: an idle node must still admit it
    assert b.can_prealloc(6, 30, allocatable=4, retractable_pages=0, ratio=0.7)
    assert not b.can_prealloc(6, 30, allocatable=3, retractable_pages=0, ratio=0.7)
