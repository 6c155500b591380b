"""``KVManagerBase``: what both KV managers are built from.

Each manager (``transfer.prefill.PrefillKVManager``, ``transfer.decode.DecodeKVManager``) is
one of these plus its own parts; the base holds only what the two do alike::

    identity        args, engine, config, instance_id (a fresh one per process: a restarted
                    rank on the same endpoint is told apart by it)
    room table      RoomTable[R] and its lock, the one lock of the manager
    control plane   transfer.zmq_io.ControlPlane: stop event, PUSH sockets, PULL endpoint
    start-up        register the rank's buffers with the engine; if that (or the rest of the
                    role's start-up) fails, abandon the plane and raise TransferError
    close()         stop -> the role winds down -> join the threads -> close the plane ->
                    close the engine, unless a thread is stuck (then the engine is leaked)

The engine is the caller's until the constructor returns (the factory closes it if the
constructor raises) and the manager's afterwards: ``close()`` closes it.
"""
from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import ClassVar, Generic

from transfer.args import KVArgs
from transfer.base import DataPlane
from transfer.config import KVManagerConfig
from transfer.control_auth import control_auth
from transfer.errors import TransferError
from transfer.rooms import R, RoomTable
from transfer.zmq_io import ControlPlane


class KVManagerBase(ABC, Generic[R]):
    """Identity, room table, control plane, buffer registration and teardown of one KV manager.

    ``__init__`` opens the control plane (a bound socket and a ZMQ context): a subclass
    allocates whatever may fail on its own (staging memory) before calling it, and runs the
    rest of its start-up inside ``_starting()``, so a failure leaves nothing open.
    """

    ROLE: ClassVar[str]  # "prefill" or "decode": names the manager in its start-up error

    def __init__(self, args: KVArgs, engine: DataPlane, config: KVManagerConfig, rooms: RoomTable[R]) -> None:
        self.args, self.engine, self.config = args, engine, config
        self.instance_id = uuid.uuid4().hex
        self._rooms = rooms
        self._lock = rooms.lock
        self._plane = ControlPlane(args.host, control_auth(config.cluster_secret))
        self._stop, self._push, self.endpoint = self._plane.stop, self._plane.push, self._plane.endpoint

    # --- start-up ------------------------------------------------------------------------------
    @contextmanager
    def _starting(self) -> Iterator[None]:
        """The start-up steps after the plane opened: if one fails, the plane is closed (no
        thread runs yet) and the failure comes out as TransferError."""
        try:
            yield
        except Exception as exc:
            self._plane.abandon()
            raise TransferError(f"{self.ROLE} transfer manager failed to start: {exc}") from exc

    def _register(self, buffers: Iterable[tuple[int, int]]) -> None:
        """Register (ptr, nbytes) memory with the engine: the rank's KV, aux and state buffers
        and the role's staging (call inside ``_starting()``)."""
        for ptr, nbytes in buffers:
            self.engine.register(ptr, nbytes)

    # --- scheduler-facing ----------------------------------------------------------------------
    def set_state_listener(self, fn: Callable[[], None]) -> None:
        """``fn`` runs (on a transfer thread, the lock held: it must be quick and never block)
        whenever a handle's ``poll()`` answer may have changed, so the scheduler loop can stop
        waiting at once instead of polling its rooms on a timer."""
        self._rooms.set_listener(fn)

    def num_rooms(self) -> int:
        return len(self._rooms)

    def close(self) -> None:
        """Stop threads, close sockets, release the engine (idempotent).

        ``_wind_down`` (the role's steps, ``stop`` already set) makes every thread exit soon and
        says how long to wait for them and how long the messages still queued get to leave.
        The engine is closed only once every thread has exited: closing it unregisters memory
        a write in flight may still touch, so if one is stuck the engine is leaked instead.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        join_s, flush_s = self._wind_down()
        stuck = self._plane.join(join_s)
        self._plane.close(flush_s=flush_s)
        if stuck:
            # logged under the role's module, as each manager's other lines are
            logging.getLogger(type(self).__module__).error(
                "transfer threads %s did not stop; the data plane is left open", stuck)
            return
        self.engine.close()

    @abstractmethod
    def _wind_down(self) -> tuple[float, float]:
        """The role's part of ``close()``: (seconds to wait for the threads in all, seconds the
        queued messages get to leave when the sockets close)."""
