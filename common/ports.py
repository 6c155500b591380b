"""Picking a free TCP port for a process about to start.

A port picked now and bound later by another process can be taken in between. Binding port 0
takes the next one from the kernel's ephemeral range, which is also where every outgoing
connection's local port and every "random port" bind of the nodes comes from (pyzmq's
``bind_to_random_port`` draws from 49152-65535): a node's KV-event socket once took the HTTP port
picked for the node started after it. So ``free_port`` draws at random from below the ephemeral
range, where nothing is handed out unasked, and checks that it binds now.
"""
from __future__ import annotations

import random
import socket

LOWEST = 20000  # above the registered services most machines run
_FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default when the range cannot be read


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port on ``host`` that binds now, outside the ephemeral range when the range leaves room."""
    high = ephemeral_low() - 1
    if high - LOWEST >= 1000:
        for _ in range(tries):
            port = random.randint(LOWEST, high)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # a machine whose ephemeral range starts low: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
