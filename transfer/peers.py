"""Decode-side knowledge of prefill ranks: the connection cache entry and the liveness probe.

A ``Peer`` is one prefill rank this decode talks to, keyed by its control endpoint. It is created
by a bootstrap lookup, holds whether our KV args were registered there, and carries heartbeat
bookkeeping (Ping sequence numbers sent and acknowledged). When a peer is declared dead it is
dropped together with every route to it and its PUSH socket, so the next room looks the rank up
again and reaches a restarted prefill at once.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from bootstrap_server.schema import RankInfo


@dataclass
class Peer:
    bootstrap_addr: str
    info: RankInfo
    registered: bool = False  # our KVArgsRegister was queued to it
    sent_seq: int = 0  # last Ping sent
    acked_seq: int = 0  # highest Pong received
    misses: int = 0  # consecutive heartbeat periods without a Pong

    @property
    def endpoint(self) -> str:
        return self.info.endpoint

    def heartbeat_tick(self) -> int:
        """Account for the last period; return the next Ping seq to send."""
        self.misses = self.misses + 1 if self.acked_seq < self.sent_seq else 0
        self.sent_seq += 1
        return self.sent_seq


def port_closed(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when nothing listens on host:port any more (the process that owned it is gone).

    A refused connection proves the prefill rank's process released its control port, so it can no
    longer write into our memory. A timeout or success proves nothing (hung, or network down).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
