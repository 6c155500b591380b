"""common/pd_contract.py: the router <-> node contract both sides share (docs/PROTOCOL.md)."""
from __future__ import annotations

import pytest

from common.pd_contract import MAX_ROOM, all_ints, bootstrap_fields, is_int, is_room, sequence_room


def test_rooms_fit_the_int64_the_aux_row_stores() -> None:
    import numpy as np  # an independent reference for int64's range

    assert MAX_ROOM == np.iinfo(np.int64).max
    assert is_room(0) and is_room(MAX_ROOM)
    assert not is_room(-1) and not is_room(MAX_ROOM + 1) and not is_room(True) and not is_room(1.0)


@pytest.mark.parametrize(("ids", "ok"), [([1, 2, 3], True), ([], True), ([1, True], False), ([1, 2.0], False),
                                         ([1, "2"], False), ([1, None], False)])
def test_token_id_lists_hold_json_integers_only(ids: list, ok: bool) -> None:
    assert all_ints(ids) is ok
    assert is_int(5) and not is_int(False) and not is_int("5")


def test_a_scalar_room_stands_for_consecutive_rooms_that_wrap() -> None:
    assert [sequence_room(10, i) for i in range(3)] == [10, 11, 12]
    assert [sequence_room(MAX_ROOM - 1, i) for i in range(3)] == [MAX_ROOM - 1, MAX_ROOM, 0]


def test_bootstrap_fields_are_scalars_or_one_entry_per_item() -> None:
    assert bootstrap_fields("h", None, 7, None) == {"bootstrap_host": "h", "bootstrap_port": None, "bootstrap_room": 7}
    assert bootstrap_fields("h", 9, 7, 2) == {"bootstrap_host": ["h", "h"], "bootstrap_port": [9, 9],
                                              "bootstrap_room": [7, 8]}


def test_the_api_and_the_router_share_the_contract_rather_than_copy_it() -> None:
    from common.ipc import protocol
    from common.server import parse_common
    from router import parse, rooms

    assert parse_common.all_ints is all_ints and parse_common.is_int is is_int and parse.all_ints is all_ints
    assert rooms.MAX_ROOM == protocol.MAX_BOOTSTRAP_ROOM == MAX_ROOM
