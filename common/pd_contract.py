"""The router <-> node PD contract, in one place: stdlib only, so the router may import it.

The router (``router/parse.py``, ``router/rooms.py``) and both nodes (through
``common/server/parse_common.py``) read and write these fields with these rules; docs/PROTOCOL.md
"Worker HTTP API" and "Rooms" describe them.

- Every PD request body carries ``bootstrap_host`` (str), ``bootstrap_port`` (int, or null for
  the node's default) and ``bootstrap_room`` (int), each a scalar or a list with one entry per
  sequence (sglang-router sends lists for a /generate batch and a chat request with n > 1).
- A room is an integer in [0, MAX_ROOM]: the transfer's aux row stores it as int64.
- A scalar room for a request of k sequences stands for rooms room + i (i < k), wrapped into
  [0, MAX_ROOM], as SGLang derives them; both nodes see the same body and agree.
- A token-id prompt is a list of JSON integers (not bools).
"""
from __future__ import annotations

from typing import Any

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
BOOTSTRAP_FIELDS = (BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM)

MAX_ROOM = 2**63 - 1

_INT = {int}


def is_int(v: Any) -> bool:
    """A JSON integer: Python's bool is an int, JSON's true is not."""
    return isinstance(v, int) and not isinstance(v, bool)


def all_ints(v: list) -> bool:
    """Every item a JSON integer (not a bool): the check of a token-id list, in C (a prompt is
    thousands of ids; a Python-level check per id cost more than the rest of parsing)."""
    return set(map(type, v)) <= _INT


def is_room(v: Any) -> bool:
    return is_int(v) and 0 <= v <= MAX_ROOM


def sequence_room(base: int, i: int) -> int:
    """The room of sequence ``i`` of a request that carries the one scalar room ``base``."""
    return (base + i) % (MAX_ROOM + 1)


def bootstrap_fields(host: str, port: int | None, room: int, items: int | None) -> dict[str, Any]:
    """The fields a router adds to both legs: lists of ``items`` entries (one room per item, as
    sglang-router sends a batch of single samples), or scalars when ``items`` is None."""
    if items is not None:
        return {BOOTSTRAP_HOST: [host] * items, BOOTSTRAP_PORT: [port] * items,
                BOOTSTRAP_ROOM: [sequence_room(room, i) for i in range(items)]}
    return {BOOTSTRAP_HOST: host, BOOTSTRAP_PORT: port, BOOTSTRAP_ROOM: room}
