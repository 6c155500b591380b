"""Decode-side KV memory policy: when a room may get its pages, and whom to retract when the pool runs dry.

Everything here is plain arithmetic over page counts (no pools, no requests), so it is
unit-tested on hand-made numbers. The decode scheduler describes each request that holds or is
promised pages as a ``Holder`` and asks three questions:

1. ``allocatable_pages``: how many pages a *new* room may take without starving the requests
   already here. Free pages minus, whichever is larger,
     a. the decode headroom of every running / waiting / in-transfer request: room for its next
        ``max(reserved_decode_tokens, ratio * steps_left)`` tokens (capped at ``steps_left``);
     b. what the largest running request would still need to finish if every other running
        request were retracted (``need_space_for_single_req``),
   minus what each retracted request needs to come back (they resume before new admissions).
2. ``can_prealloc``: the two checks of a room (seed 001, "Detailed Decode Processing")::

       immediate   pages(prompt + headroom)                            <= allocatable
       worst case  pages(prompt + min(max_new, clip)) - retractable     <= allocatable

   ``retractable`` = pages held by running requests: in the worst case we could retract them
   all and this request alone would still finish. Both are capped at the pool size so a request
   longer than the whole pool is still admitted when the node is idle (it is finished with an
   error if it really outgrows the pool).
3. ``pick_victims``: the next decode step needs one page per request whose last page is full.
   When the free pages do not cover it, retract (in order) the running request with the fewest
   output tokens, ties broken by the longest prompt — it has streamed the least and frees the
   most — until the rest fit for ``retract_decode_steps`` more steps. One request always stays.

``NewTokenRatio`` is seed 000 §9.3: the share of a request's remaining ``max_new_tokens`` kept as
headroom starts conservative (0.7), decays linearly every decode step to a floor (0.1), after a
retraction jumps back up to what the surviving requests have really been using, and returns to
its start whenever the node is idle (as SGLang does when its running batch empties).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import SchedulerConfig

CLIP_MAX_NEW_TOKENS = 4096  # worst-case estimates never assume more than this many new tokens


@dataclass(frozen=True)
class DecodeBudgetConfig:
    """The budget's view of the node's settings (``from_sched``; the settings and their defaults
    are declared once, in ``common.config.SchedulerConfig``) plus the pool it budgets."""

    page_size: int
    total_pages: int  # usable pages of the pool
    reserved_decode_tokens: int  # headroom per request; SGLang's default is 512 (GPU pools)
    ratio_init: float
    ratio_min: float
    ratio_decay_steps: int
    # Not settings: fixed parts of the policy.
    clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS
    retract_decode_steps: int = 20  # after a retraction the survivors must fit this many steps

    @classmethod
    def from_sched(cls, s: SchedulerConfig, page_size: int, total_pages: int) -> DecodeBudgetConfig:
        return cls(page_size=page_size, total_pages=total_pages, reserved_decode_tokens=s.reserved_decode_tokens,
                   ratio_init=s.new_token_ratio_init, ratio_min=s.new_token_ratio_min,
                   ratio_decay_steps=s.new_token_ratio_decay_steps)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.total_pages < 1:
            raise ValueError(f"DecodeBudgetConfig needs page_size, total_pages >= 1, got {self.page_size}, {self.total_pages}")
        if self.reserved_decode_tokens < 1 or self.retract_decode_steps < 1 or self.clip_max_new_tokens < 1:
            raise ValueError("reserved_decode_tokens, retract_decode_steps, clip_max_new_tokens must be >= 1")
        if not 0.0 <= self.ratio_min <= self.ratio_init <= 1.0 or self.ratio_decay_steps < 1:
            raise ValueError(f"need 0 <= ratio_min <= ratio_init <= 1 and decay_steps >= 1, got "
                             f"{self.ratio_min}, {self.ratio_init}, {self.ratio_decay_steps}")


@dataclass(frozen=True)
class Holder:
    """One request as the budget sees it.

    ``kv_len``: tokens whose KV the request holds or is promised (for a room in transfer: its
    prompt). ``steps_left``: decode steps it may still run, each writing one token's KV
    (``max_new_tokens - max(len(output), 1)``; the first token comes from the prefill and writes
    nothing here). ``held_pages``: pages it owns now.
    """

    kv_len: int
    steps_left: int
    held_pages: int
    output_len: int = 0
    prompt_len: int = 0


class NewTokenRatio:
    def __init__(self, init: float, floor: float, decay_steps: int) -> None:
        self.init = init
        self.floor = floor
        self.decay = (init - floor) / decay_steps
        self.value = init

    def reset(self) -> None:
        """Back to the conservative start (an idle node: the next busy period learns afresh)."""
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.floor)

    def on_retract(self, survivors: Sequence[Holder], steps: int) -> None:
        """Re-estimate from what the surviving requests really used (SGLang's retract_decode),
        never relaxing: a retraction says the current ratio was too optimistic."""
        decoded = sum(h.output_len for h in survivors)
        max_new = sum(h.output_len + h.steps_left for h in survivors)
        estimate = min(1.0, (decoded + steps * len(survivors)) / (max_new + 1))
        self.value = max(self.value, estimate)


class DecodeBudget:
    def __init__(self, cfg: DecodeBudgetConfig) -> None:
        self.cfg = cfg

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.cfg.page_size)

    def headroom_tokens(self, steps_left: int, ratio: float) -> int:
        want = max(self.cfg.reserved_decode_tokens, math.ceil(ratio * min(steps_left, self.cfg.clip_max_new_tokens)))
        return max(0, min(want, steps_left))

    def headroom_pages(self, h: Holder, ratio: float) -> int:
        """Pages ``h`` still needs for its headroom beyond those it holds."""
        return max(0, self.pages(h.kv_len + self.headroom_tokens(h.steps_left, ratio)) - h.held_pages)

    def allocatable_pages(self, free_pages: int, running: Sequence[Holder], queued: Sequence[Holder],
                          retracted: Sequence[Holder], ratio: float) -> int:
        """Pages a new room may take. ``queued``: rooms in transfer and requests waiting to join the
        running batch; ``retracted``: requests waiting to resume (``held_pages`` 0, ``kv_len`` what
        they must recompute)."""
        headroom = sum(self.headroom_pages(h, ratio) for h in (*running, *queued))
        retractable = sum(h.held_pages for h in running)
        clip = self.cfg.clip_max_new_tokens
        single = max((self.pages(h.kv_len + min(h.steps_left, clip)) - retractable for h in running), default=0)
        comeback = sum(self.pages(h.kv_len + self.headroom_tokens(h.steps_left, ratio)) for h in retracted)
        return free_pages - max(headroom, single) - comeback

    def can_prealloc(self, prompt_len: int, max_new_tokens: int, allocatable: int, retractable_pages: int,
                     ratio: float) -> bool:
        steps = max(max_new_tokens - 1, 0)
        # Capped at the pool so an idle node always admits what fits at all.
        need = min(self.pages(prompt_len + self.headroom_tokens(steps, ratio)), self.cfg.total_pages)
        if need > allocatable:
            return False
        worst = min(self.pages(prompt_len + min(steps, self.cfg.clip_max_new_tokens)), self.cfg.total_pages)
        return max(need, worst - retractable_pages) <= allocatable

    def can_resume(self, h: Holder, free_pages: int, others: Sequence[Holder], ratio: float, alone: bool) -> bool:
        """May a retracted request take its pages back now? ``alone``: nothing else runs, so only the
        next step must fit (progress is guaranteed even when headroom estimates say no)."""
        if alone:
            return self.pages(h.kv_len + min(1, h.steps_left)) <= free_pages
        reserve = sum(self.headroom_pages(o, ratio) for o in others)
        return self.pages(h.kv_len + self.headroom_tokens(h.steps_left, ratio)) <= free_pages - reserve

    def step_pages(self, h: Holder, steps: int = 1) -> int:
        """New pages ``h`` needs to run ``steps`` more decode steps."""
        return max(0, self.pages(h.kv_len + min(steps, h.steps_left)) - h.held_pages)

    def pick_victims(self, running: Sequence[Holder], free_pages: int) -> tuple[list[int], bool]:
        """Indices into ``running`` to retract, in order, and whether the survivors' next step then
        fits (False only when one request is left and even it cannot take its next page)."""
        if sum(self.step_pages(h) for h in running) <= free_pages:
            return [], True
        order = sorted(range(len(running)), key=lambda i: (running[i].output_len, -running[i].prompt_len))
        keep = set(range(len(running)))
        victims: list[int] = []
        free = free_pages
        steps = self.cfg.retract_decode_steps
        for i in order:
            if len(keep) == 1 or sum(self.step_pages(running[j], steps) for j in keep) <= free:
                break
            keep.discard(i)
            victims.append(i)
            free += running[i].held_pages
        return victims, sum(self.step_pages(running[j]) for j in keep) <= free
