"""Per-request stage timelines: measured where each stage happens, summed where they meet.

Each scheduler keeps a ``StageClock`` per request: consecutive laps from the moment it took the
request to the moment it answered, so its stages add up to its own span exactly. The final
``ReqOutput`` carries them (``StageTimes``); the node's API process adds the hops it sees
(``api_in``: HTTP request in -> scheduler took it, ``api_out``: scheduler answered -> response
out) and puts the result in ``meta_info["timeline"]``; the router (``router/timeline.py``) adds
its own stages around the decode's and nests the prefill's.

Clocks: a node's API and scheduler processes share a host, so their ``time.time()`` marks are
compared directly. Across the router and the nodes only durations travel: a node's total is
fitted into the router's measured span of that request, and what is left is the network/HTTP
hop, measured as a difference, never as a clock comparison between hosts.
"""
from __future__ import annotations

import time

import msgspec

# Stage names, in order, per role (docs/OPERATIONS.md lists what each covers).
PREFILL_STAGES = ("bootstrap", "queue", "forward", "transfer")
DECODE_STAGES = ("prealloc", "kv_transfer", "first_token", "decode")
# A decode's local request (no room: it computes its prompt itself) instead of the first two.
LOCAL_DECODE_STAGES = ("local_prefill", "first_token", "decode")


class StageTimes(msgspec.Struct, kw_only=True):
    """A scheduler's stages of one request (seconds, in order) and when it took the request."""

    role: str  # "prefill" | "decode"
    received_at: float  # time.time() when the scheduler took the request
    stages: dict[str, float]
    forwards: int = 0  # prefill: forward passes of this prompt; decode: decode steps


class StageClock:
    """Consecutive laps of one request in a scheduler (wall clock, see the module docstring)."""

    __slots__ = ("role", "received_at", "_last", "stages", "forwards", "order")

    def __init__(self, role: str, now: float | None = None) -> None:
        self.role = role
        # Stages reported in this order, 0 where a request never lapped one (a prompt computed
        # ahead of its decode's answer laps bootstrap after its forward, or not at all); others
        # follow in the order they were first lapped.
        self.order: tuple[str, ...] = ()
        self.received_at = self._last = time.time() if now is None else now
        self.stages: dict[str, float] = {}
        self.forwards = 0

    def lap(self, stage: str, now: float | None = None) -> None:
        """Time since the previous lap goes to ``stage`` (added up when a stage recurs)."""
        now = time.time() if now is None else now
        self.stages[stage] = self.stages.get(stage, 0.0) + max(now - self._last, 0.0)
        self._last = now

    def times(self) -> StageTimes:
        stages = {k: self.stages.get(k, 0.0) for k in self.order} | self.stages
        return StageTimes(role=self.role, received_at=self.received_at, stages=stages, forwards=self.forwards)


def node_timeline(times: StageTimes, arrival: float, now: float | None = None) -> dict:
    """``meta_info["timeline"]`` of a node: its API hops around its scheduler's stages (ms)."""
    now = time.time() if now is None else now
    sched = sum(times.stages.values())
    stages = {"api_in": max(times.received_at - arrival, 0.0), **times.stages}
    stages["api_out"] = max(now - times.received_at - sched, 0.0)
    return {"role": times.role, "total_ms": _ms(now - arrival), "stages_ms": {k: _ms(v) for k, v in stages.items()},
            "forwards": times.forwards}


def _ms(s: float) -> float:
    return round(s * 1000.0, 3)
