"""free_port picks below the kernel's ephemeral range, so a random-port bind or an outgoing
connection elsewhere cannot take it before its process binds it."""
from __future__ import annotations

import socket

import zmq

from common.ports import LOWEST, ephemeral_low, free_port


def test_free_ports_bind_and_stay_out_of_the_ranges_others_draw_from() -> None:
    low = ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random, not handed out in sequence
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    try:
        zmq_port = sock.bind_to_random_port("tcp://127.0.0.1")  # what the nodes' event sockets do
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            kernel_port = s.getsockname()[1]
        for port in ports:
            if low - 1 - LOWEST >= 1000:
                assert LOWEST <= port < low, port
            assert port not in (zmq_port, kernel_port)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    finally:
        sock.close(linger=0)


def test_a_taken_port_is_never_returned(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import common.ports as ports

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, taken])  # every draw is the taken port: skipped, then the kernel's pick
        monkeypatch.setattr(ports, "LOWEST", 1024)
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports.random, "randint", lambda a, b: next(draws))
        assert free_port(tries=2) != taken
