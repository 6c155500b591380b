"""Mooncake transfer engine data plane (RDMA when a device exists, TCP otherwise).

Facts this wrapper relies on (measured, see docs/TRANSFER.md): ``batch_transfer_sync_write`` returns
0 on success and < 0 on failure; a dead peer fails within ~1 s, a hung (SIGSTOPped) one
blocks for ``MC_TRANSFER_TIMEOUT`` seconds (default 30; measured: values below 5 act as 5), so
we set a short one; batches above ~2050 entries per peer
fail, so callers split to ``max_batch_entries``; ``MC_TCP_PROTO=1`` acknowledges writes before
they land and is therefore removed from the environment.
"""
from __future__ import annotations

import logging
import math
import os
import threading

from transfer.base import DataPlane
from transfer.descriptors import Descriptors
from transfer.errors import TransferError

log = logging.getLogger(__name__)


def auto_protocol() -> str:
    """What ``protocol="auto"`` picks: "rdma" when this host has an RDMA device, else "tcp"."""
    ib = "/sys/class/infiniband"
    return "rdma" if os.path.isdir(ib) and os.listdir(ib) else "tcp"


class MooncakeDataPlane(DataPlane):
    name = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "auto",
        device: str = "",
        transfer_timeout_s: float = 5.0,
        max_batch_entries: int = 2000,
        **_: object,
    ) -> None:
        # Mooncake reads its settings from the environment when the engine starts.
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(transfer_timeout_s)))
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        if os.environ.pop("MC_TCP_PROTO", None) is not None:
            log.warning("ignoring MC_TCP_PROTO: it reports writes as done before they land")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError("mooncake backend needs mooncake-transfer-engine(-non-cuda) installed") from exc
        proto = auto_protocol() if protocol == "auto" else protocol
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", proto, device)
        if rc != 0:
            raise TransferError(f"mooncake initialize({host!r}, {proto!r}, {device!r}) failed with {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self.max_batch_entries = max_batch_entries
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last running write returns
        self._writes = 0  # engine writes running now (close waits for them)
        # A write blocks at most MC_TRANSFER_TIMEOUT (rounded up, floor 5 s as measured).
        self._close_wait_s = max(5, math.ceil(transfer_timeout_s)) + 5.0
        self._closed = False
        log.info("mooncake engine up: session %s protocol %s", self._session, proto)

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"mooncake register_memory({ptr:#x}, {nbytes}) failed with {rc}")
        self._registered.append(ptr)

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._writes += 1
        try:
            rc = self._engine.batch_transfer_sync_write(peer_session, desc.src, desc.dst, desc.lens)
        finally:
            with self._lock:
                self._writes -= 1
                if self._writes == 0:
                    self._idle.notify_all()
        if rc != 0:
            log.warning("mooncake write of %d descriptors to %s failed (%d)", len(desc), peer_session, rc)
        return rc == 0

    def close(self) -> None:
        """Refuse new writes, wait for the running ones, then unregister and drop the engine.

        Unregistering memory or destroying the engine under a running write is undefined
        behaviour in the engine; if a write outlives its own timeout, the engine is left alive.
        """
        with self._idle:
            if self._closed:
                return
            self._closed = True
            if not self._idle.wait_for(lambda: self._writes == 0, timeout=self._close_wait_s):
                log.error("mooncake: %d write(s) still running after %gs; engine left open", self._writes,
                          self._close_wait_s)
                return
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered.clear()
        del self._engine  # the engine's threads and ports go with the last reference
