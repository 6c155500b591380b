"""What the prefill scheduler is built on, as Protocols: the engine that runs prompt chunks and the
factory of KV senders. The node wires the real ones (``common.engine.driver.EngineDriver``,
``transfer.prefill.PrefillKVManager.create_sender`` behind ``transfer.agreed``); the unit tests
pass fakes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from common.engine.driver import SampleSpec
from common.engine.model_runner import ExtendChunk
from common.engine.sampler import SampledToken
from transfer.base import KVSender


class ExtendEngine(Protocol):
    """``common.engine.driver.EngineDriver`` fits: one forward over prompt chunks, sampled tokens out."""

    def run_extend(self, chunks: Sequence[ExtendChunk], specs: Sequence[SampleSpec | None]) -> list[SampledToken | None]: ...


SenderFactory = Callable[..., KVSender]  # PrefillKVManager.create_sender(room, prompt_digest=); raises TransferError
