"""A request as the decode scheduler tracks it, and the collaborators it needs from outside.

The stage says which queue holds the request and what it owns::

    stage        queue        owns
    PREALLOC     prealloc     receiver
    TRANSFER     transfer     receiver, row + prompt pages, aux slot
    WAITING      waiting      row + prompt pages (KV landed; first token read from aux)
    RUNNING      running      row + pages
    RETRACTED    retracted    nothing (tokens only; resumes by recompute)
    DRAINING     draining     receiver (+ pages, aux slot): answered, waits until no write can land
    DONE         -            nothing
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.engine.driver import SampleSpec
from common.engine.model_runner import DecodeItem, ExtendChunk
from common.engine.sampler import SampledToken
from common.kvcache.req_kv import ReqKV
from common.ipc.protocol import ReqOutput
from common.request import FinishReason, SamplingParams
from decode_node.budget import Holder
from common.timeline import StageClock
from transfer.aux import AuxRecord
from transfer.base import KVReceiver


class Stage(enum.Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    DRAINING = "draining"
    DONE = "done"


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


@dataclass
class DecodeReq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    room: int | None  # None: a local request (no prefill), computed here from the prompt
    bootstrap_addr: str | None
    arrival: float
    stage: Stage = Stage.PREALLOC
    receiver: KVReceiver | None = None
    kv: ReqKV | None = None
    aux_slot: int | None = None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: int = 0  # output tokens already sent to the API process
    cached_tokens: int = 0  # prompt tokens the prefill served from its prefix cache
    finish: FinishReason | None = None
    error: str | None = None
    http_status: int | None = None
    retractions: int = 0
    drain_since: float = 0.0
    clock: StageClock = field(default_factory=lambda: StageClock("decode"))  # prealloc, kv_transfer, first_token, decode
    _spec: SampleSpec | None = field(default=None, repr=False)

    def sample_spec(self) -> SampleSpec:
        """One spec for the request's life: it reads the live output list when sampling."""
        if self._spec is None:
            self._spec = SampleSpec(self.params, self.out, self.prompt)
        return self._spec

    @property
    def max_new(self) -> int:
        return self.params.max_new_tokens

    @property
    def steps_left(self) -> int:
        """Decode steps this request may still run (each writes one token's KV)."""
        return max(self.max_new - max(len(self.out), 1), 0)

    def recompute_ids(self) -> Sequence[int]:
        """Tokens whose KV a resumed request needs: prompt + every output token but the newest
        (the newest is the next decode step's input). A local request with no output yet
        computes its whole prompt and samples its first token from the last chunk."""
        return self.prompt + self.out[:-1]

    def label(self) -> str:
        return f"rid {self.rid}" + (f" (room {self.room})" if self.room is not None else "")

    def holder(self) -> Holder:
        """This request as the memory budget sees it."""
        if self.kv is None:  # retracted: what it must recompute
            kv_len, held = len(self.recompute_ids()), 0
        else:  # a room in transfer is promised its whole prompt
            kv_len, held = max(self.kv.kv_len, len(self.prompt)), len(self.kv.pages)
        return Holder(kv_len=kv_len, steps_left=self.steps_left, held_pages=held, output_len=len(self.out),
                      prompt_len=len(self.prompt))

    def take_output(self) -> ReqOutput:
        """Everything new since the last output; counters are running totals."""
        new = slice(self.sent, len(self.out))
        lp = self.params.return_logprob
        self.sent = len(self.out)
        timeline = None
        if self.finish is not None and self.error is None and self.room is not None:
            self.clock.lap("decode")
            self.clock.forwards = max(len(self.out) - 1, 0)  # decode steps (the first token came from the prefill)
            timeline = self.clock.times()
        return ReqOutput(
            rid=self.rid, new_token_ids=self.out[new], new_logprobs=self.logprobs[new] if lp else None,
            new_top_logprobs=self.top_logprobs[new] if lp and self.params.top_logprobs_num else None,
            finish=self.finish, prompt_tokens=len(self.prompt), completion_tokens=len(self.out),
            cached_tokens=self.cached_tokens, error=self.error, http_status=self.http_status, timeline=timeline)
