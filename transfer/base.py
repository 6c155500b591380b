"""Backend-agnostic contracts of the transfer layer.

Roles are split: a prefill process owns one ``PrefillKVManager`` handing out a ``KVSender`` per
room; a decode process owns one ``DecodeKVManager`` handing out a ``KVReceiver`` per room.
Senders and receivers are cheap handles; ``poll()`` is a non-blocking read that the scheduler
calls every step. All network work happens on the managers' daemon threads.

A ``DataPlane`` is what a backend (mooncake, fake) provides: memory registration and a blocking
batched one-sided write. The ``BootstrapClient`` finds a prefill rank's control endpoint and
layout through the prefill node's bootstrap HTTP registry.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from bootstrap_server.schema import PrefillLayout, RankInfo
from transfer.aux import AuxRecord
from transfer.descriptors import Descriptors
from transfer.poll import KVPoll


class KVSender(ABC):
    """Prefill side of one room.

    Contract: ``poll()`` starts at Bootstrapping, reaches WaitingForInput once the decode told us
    where to write; the scheduler then calls ``send`` once per finished chunk, in token order,
    the last one with ``last_chunk=True`` and the room's ``aux`` record. Success means every byte
    landed on the decode. Failed is reported only when no write for the room is in flight any
    more, so the caller may free the room's pages as soon as it sees a terminal state.
    """

    room: int

    @abstractmethod
    def send(
        self,
        page_indices: Sequence[int],
        last_chunk: bool,
        aux: AuxRecord | None = None,
        state_indices: Sequence[int] = (),
    ) -> None:
        """Queue the chunk's pages (prefill page ids, in order). Never blocks on the network."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Current state; non-blocking, monotonic, terminal states sticky."""

    @abstractmethod
    def abort(self, reason: str = "aborted by prefill") -> None:
        """Fail the room (idempotent); the decode is told once no write is in flight."""

    @property
    @abstractmethod
    def failure_reason(self) -> str | None:
        """Why the room failed (None unless poll() is Failed)."""

    @property
    def decode_prefix_len(self) -> int:
        """Prompt tokens whose KV the decode already holds (a whole number of pages; known once
        the room is WaitingForInput): ``send`` then hands only the pages past them."""
        return 0


class KVReceiver(ABC):
    """Decode side of one room.

    Contract: ``poll()`` starts at Bootstrapping (finding the prefill rank, registering our
    buffers), reaches WaitingForInput when ``init`` may be called, Transferring once the prefill
    knows our pages, Success when KV and aux landed. Failed is reported when no write for the
    room can still land (the prefill said so after its in-flight writes, or it is gone), or when
    the prefill stopped answering past its bound: then ``fenced()`` is True and the caller must
    keep the pages, aux slot and state items out of its pools until ``fenced()`` turns False
    (the peer is proven unable to write; it may never happen for a peer that never returns).
    """

    room: int
    #: The KV came from a prefill of another TP size, so this rank's pages hold other head
    #: ranges than the prefill's KV digest covers (known once the room left Bootstrapping).
    resharded: bool = False

    @abstractmethod
    def init(self, page_indices: Sequence[int], aux_slot: int | None, state_indices: Sequence[int] = (),
             prompt_digest: str = "", decode_prefix_len: int = 0) -> None:
        """Tell the prefill where to write (decode page ids in token order) and for which prompt
        (``messages.prompt_digest``: the prefill refuses a room it computes for another). With
        ``decode_prefix_len`` (a whole number of pages) this node holds the prompt's first
        tokens already: ``page_indices`` are the pages past them, the only ones written. Never blocks."""

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def abort(self, reason: str = "aborted by decode") -> None: ...

    @property
    @abstractmethod
    def failure_reason(self) -> str | None: ...

    def fenced(self) -> bool:
        """Failed, but a write may still land: hold its memory (see the class docstring)."""
        return False


class DataPlane(ABC):
    """One-sided writes into registered peer memory (one engine per manager)."""

    name: str
    #: Most descriptors one ``write`` call may carry to one peer.
    max_batch_entries: int = 2000

    @property
    @abstractmethod
    def session_id(self) -> str:
        """How peers address this engine (e.g. "host:rpc_port"); new for every engine instance."""

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def write(self, peer_session: str, desc: Descriptors) -> bool:
        """Blocking batched write; True when every descriptor landed, False on any failure."""

    @abstractmethod
    def close(self) -> None:
        """Unregister memory and release the engine (idempotent)."""


class BootstrapClient(Protocol):
    """Synchronous client of the bootstrap registry; raises ``BootstrapError`` subclasses.

    ``bootstrap_server.client`` (the module) satisfies it; ``transfer.bootstrap.HttpBootstrapClient``
    binds a timeout. Calls run on manager threads, never on the scheduler's.
    """

    def register_rank(self, url: str, info: RankInfo) -> None: ...

    def deregister_rank(self, url: str, info: RankInfo) -> None:
        """Remove exactly this incarnation of the rank (best effort, at manager close)."""
        ...

    def lookup_layout(self, url: str) -> PrefillLayout:
        """The node's layout once every rank registered (``PrefillLayout.complete``); raises
        ``RankNotRegistered`` when they do not within the client's bound."""
        ...

    def lookup_rank(self, url: str, engine_rank: int, dp_group: int) -> RankInfo: ...
