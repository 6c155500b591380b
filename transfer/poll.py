"""KVPoll: the per-room transfer state machine shared by both roles.

::

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\               \\                 \\
           `----------------`-----------------`---> Failed

Values are ordered so that a min-reduce across TP ranks yields the least advanced state and
Failed (0) wins over everything. Transitions only move forward; Success and Failed are terminal
and sticky: once a room reached one, no later event changes it.
"""
from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


def can_advance(current: KVPoll, new: KVPoll) -> bool:
    """True when ``current -> new`` is a legal move (forward, or to Failed from a live state)."""
    if current.terminal:
        return False
    if new is KVPoll.Failed:
        return True
    return new > current


def no_listener() -> None:
    """The default state listener of a manager whose owner set none (tests, the transfer bench)."""
