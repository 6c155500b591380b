"""The pipe protocol the transfer bench and the transfer tests drive their child peers with."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection

import pytest

from common.tools.pipe_peer import PeerProcess, answer


def _echo_peer(conn: multiprocessing.connection.Connection, greeting: str) -> None:
    conn.send(("ok", greeting))
    answer(conn, {"add": lambda a, b: a + b, "fail": lambda: 1 / 0})
    conn.close()


def test_a_spawned_peer_answers_each_command_once_and_reports_failures() -> None:
    peer = PeerProcess(_echo_peer, ("hello",), name="echo peer", start_timeout_s=60)
    try:
        assert peer.info == "hello"
        assert peer.call("add", 2, 3, timeout_s=30) == 5
        with pytest.raises(RuntimeError, match="fail: ZeroDivisionError"):
            peer.call("fail", timeout_s=30)
        with pytest.raises(RuntimeError, match="unknown command 'nope'"):
            peer.call("nope", timeout_s=30)
        assert peer.call("add", "a", "b", timeout_s=30) == "ab"  # still serving after both errors
    finally:
        peer.stop()
    assert not peer.proc.is_alive() and peer.proc.exitcode == 0  # "close" ended it, no kill needed


def test_the_loop_ends_when_the_parent_goes_away() -> None:
    parent, child = multiprocessing.Pipe()
    parent.close()
    answer(child, {})  # EOF on the first recv: returns instead of raising
