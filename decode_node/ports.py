"""What the decode scheduler is built on, as Protocols: the decode side of the transfer layer, the
engine (forward + sample as plain data) and the aux slots the prefill writes each room's first
token into. The node wires the real ones (``transfer.decode.DecodeKVManager`` behind
``transfer.agreed``, ``common.engine.driver.EngineDriver``, ``transfer.aux.AuxPool``); the unit
tests pass fakes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from transfer.aux import AuxRecord
from transfer.base import KVReceiver


class ReceiverFactory(Protocol):
    """The decode side of the transfer layer as the scheduler uses it."""

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        """A receiver for ``room`` whose prefill's bootstrap server is ``host:port``. Raises
        ``TransferError`` when the room cannot be taken (e.g. already in flight here)."""
        ...

    def reject_room(self, room: int, bootstrap_addr: str, reason: str) -> None:
        """Tell that prefill we refused ``room`` without a receiver; no-op for a room live here."""
        ...


class Engine(Protocol):
    """Forward + sample as plain data (``common.engine.driver.EngineDriver`` fits)."""

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]: ...

    def run_decode(self, items: Sequence[DecodeItem], specs: Sequence[SampleSpec]) -> list[SampledToken]: ...


class AuxSlots(Protocol):
    """Where the prefill writes each room's first token (``transfer.aux.AuxPool`` fits)."""

    def alloc(self) -> int | None: ...

    def read(self, slot: int) -> AuxRecord: ...

    def free(self, slot: int) -> None: ...

    def num_free(self) -> int: ...

    def check_integrity(self) -> None: ...
