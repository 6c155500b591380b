"""Messages between a node's API process and its scheduler process (tagged msgspec Structs).

Transport: two one-way ZMQ ``ipc://`` sockets per node, made by ``IpcEndpoints``::

    API process                                   scheduler process
    PUSH --connect--> to_scheduler   --bind--  PULL     GenerateReq | AbortReq | FlushCacheReq | QueryReq
    PULL --bind-----  from_scheduler <-connect- PUSH    BatchOutput | QueryReply

Each process binds the socket it *receives* on, so either side may start first (ZMQ queues a
PUSH until its peer binds). One frame = one message, msgpack-encoded by ``encode``; the tag
field ``"type"`` names the message. A frame that does not decode is logged and dropped by
``decode_to_scheduler`` / ``decode_from_scheduler`` (they return ``None``): a malformed message
must never kill a loop.

Contract for scheduler authors
------------------------------
``GenerateReq``
    One sequence to run (the API expands batches and ``n > 1`` into several, each with its own
    ``rid``). A ``rid`` is opaque and never reused by the API process: it is the client's rid plus
    ``#n`` (``common/ipc/scheduler_client.py``), so a client reusing its rid never collides with
    a sequence the scheduler still runs. The API has already validated it: ``input_ids`` is non-empty, every id is in the
    vocabulary, ``len(input_ids) < context_length`` and ``len(input_ids) +
    sampling.max_new_tokens <= context_length`` (the API clips ``max_new_tokens``). The scheduler
    still applies its own memory limits and may finish a request with an error (below).
    ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` tie the two halves of a
    disaggregated request together; when ``bootstrap_host`` is set the API has filled
    ``bootstrap_port`` (the request's own value, else the node's default). ``bootstrap_room is
    None`` marks a *local* request (``/health_generate``, a client talking to the node
    directly): the scheduler either serves it without any transfer or finishes it at once with
    ``error`` + ``http_status`` 400. ``sampling.stop`` strings must be checked by the scheduler
    too (it has to stop generating); the API only trims the text. Logprob requests live in
    ``sampling`` alone (``return_logprob``, ``top_logprobs_num``: the parser normalised them
    once); ``sampling.n`` is always 1. ``stream``
    says whether the client streams: a scheduler may send a non-streamed request's tokens in
    fewer, larger ``ReqOutput``s (the API handles any split).
``AbortReq``
    Stop ``rid`` and release everything it holds. Sent on client disconnect and
    ``/abort_request``. The scheduler answers with a final ``ReqOutput`` (``finish.type ==
    "abort"``) if it knew the rid; an unknown rid is ignored (the request may just have finished).
``FlushCacheReq``
    Drop the prefix cache. Answered with ``QueryReply(query_id, {"success": bool, "message":
    str})`` (``success`` is false while requests are running).
``QueryReq``
    The API sends ``"load"`` queries from start-up until the first answer and reports
    ``/health`` 503 until then: answer only once requests can be served (model loaded). Answered with ``QueryReply(query_id, payload)``; payload keys by ``what``:
      - ``"load"``: ``{"num_reqs": int, "num_waiting_reqs": int, "num_tokens": int}``
        (running + queued requests, queued only, tokens held in the KV pool).
      - ``"memory"``: whatever the pools' counters are (free/used/cached pages, request slots,
        aux slots, ...); served as JSON on ``GET /debug/memory``.
      - ``"metrics"``: flat ``{name: number}``; each becomes a Prometheus gauge
        ``pdc_scheduler_<name>``. Expected names: ``num_running_reqs``, ``num_waiting_reqs``,
        ``num_transfer_reqs``, ``token_usage`` (0..1), ``gen_throughput`` (tokens/s).
      - ``"kv_snapshot"``: the prefix cache's ``KVSnapshot`` (common/kv_events.py) as plain data,
        or ``{"error": ...}`` on a node that publishes no KV events.
``BatchOutput``
    Everything new since the last step for any number of requests. A ``ReqOutput`` carries only
    *new* tokens; ``finish`` is set on the last one for that rid, after which the rid is never
    mentioned again. Counters (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``) are
    running totals. ``cached_tokens`` is the prefill's prefix-cache hit (a decode relays the one
    its room's aux row carries); ``decode_reused_tokens`` is set only by a decode node, on a
    disaggregated request: the prompt tokens its own prefix cache held, whose KV was therefore not
    transferred (``decode_prefix_len``; 0 until the KV arrived); on a local request (no room: the
    router sent it to the decode alone, its conversation being cached there) it is the cached
    prefix and ``decode_computed_tokens`` the prompt tokens the decode computed itself. A request that failed (transfer failure, scheduler-side rejection) finishes
    with ``FinishReason(type="abort", message=reason)`` plus ``error`` (a sentence naming the
    cause and the room/rid) and ``http_status`` (503 for a peer that is gone or timed out, 500
    for an internal fault, 400 for a request the scheduler cannot take); the API turns it into
    that HTTP status.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

import msgspec

from common.pd_contract import MAX_ROOM
from common.request import FinishReason, SamplingParams
from common.timeline import StageTimes

logger = logging.getLogger(__name__)

_STRUCT_OPTS = dict(tag_field="type", kw_only=True)

# Rooms are minted in [0, 2^63-1] (docs/PROTOCOL.md §2, as SGLang's router) and the transfer's
# aux row stores the room as int64; the API rejects anything larger before any work is done.
MAX_BOOTSTRAP_ROOM = MAX_ROOM


# ---- API -> scheduler --------------------------------------------------------------------------


class GenerateReq(msgspec.Struct, tag="generate", **_STRUCT_OPTS):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None  # in [0, MAX_BOOTSTRAP_ROOM]
    arrival_time: float = 0.0  # time.time() when the API received the HTTP request


class AbortReq(msgspec.Struct, tag="abort", **_STRUCT_OPTS):
    rid: str


class FlushCacheReq(msgspec.Struct, tag="flush_cache", **_STRUCT_OPTS):
    query_id: str


class QueryReq(msgspec.Struct, tag="query", **_STRUCT_OPTS):
    query_id: str
    what: Literal["load", "memory", "metrics", "kv_snapshot"]


ToScheduler = GenerateReq | AbortReq | FlushCacheReq | QueryReq
WorkItem = GenerateReq | AbortReq  # what a scheduler's step() takes; NodeIO answers the queries itself


# ---- scheduler -> API --------------------------------------------------------------------------


class ReqOutput(msgspec.Struct, kw_only=True):
    rid: str
    new_token_ids: list[int] = []
    new_logprobs: list[float] | None = None  # one per new token when return_logprob
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob)
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    decode_reused_tokens: int | None = None  # None: not a decode's answer
    decode_computed_tokens: int | None = None  # a decode's local request: prompt tokens it computed
    error: str | None = None
    http_status: int | None = None
    timeline: StageTimes | None = None  # on a successful final output: the scheduler's stages


class BatchOutput(msgspec.Struct, tag="batch_output", **_STRUCT_OPTS):
    items: list[ReqOutput]


class QueryReply(msgspec.Struct, tag="query_reply", **_STRUCT_OPTS):
    query_id: str
    payload: dict


FromScheduler = BatchOutput | QueryReply


# ---- encoding ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()

M = TypeVar("M")


def encode(msg: ToScheduler | FromScheduler) -> bytes:
    return _encoder.encode(msg)


class _Decoder(Generic[M]):
    """Decode one direction's union; log and drop what does not decode."""

    def __init__(self, union: object, direction: str) -> None:
        self._dec = msgspec.msgpack.Decoder(union)
        self._direction = direction

    def __call__(self, buf: bytes) -> M | None:
        try:
            return self._dec.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping malformed %s message (%d bytes): %s", self._direction, len(buf), exc)
            return None


decode_to_scheduler: _Decoder[ToScheduler] = _Decoder(ToScheduler, "API->scheduler")
decode_from_scheduler: _Decoder[FromScheduler] = _Decoder(FromScheduler, "scheduler->API")


def new_query_id() -> str:
    return uuid.uuid4().hex


# ---- socket addresses --------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcEndpoints:
    """The two ipc addresses of one node (see the module docstring for who binds what)."""

    to_scheduler: str
    from_scheduler: str

    @classmethod
    def fresh(cls, directory: str | None = None) -> IpcEndpoints:
        """Unique addresses. On Linux, without ``directory``, they live in the abstract socket
        namespace (``ipc://@name``): no file is ever created, so a node killed with SIGKILL leaves
        nothing behind in the temp dir. Elsewhere, or with ``directory``, they are socket files
        there (paths are limited to ~100 bytes by the OS, so keep the directory short)."""
        name = f"pdc-{uuid.uuid4().hex[:12]}"
        if directory is None and sys.platform.startswith("linux"):
            base = "@" + name
        else:
            base = os.path.join(directory or tempfile.gettempdir(), name)
        return cls(to_scheduler=f"ipc://{base}-in", from_scheduler=f"ipc://{base}-out")

    def rank_wake_address(self) -> str:
        """The AF_UNIX datagram address where a TP node's other ranks wake rank 0's loop
        (``common.ipc.node_io.RankWaker``), derived from ``to_scheduler``: abstract like it on
        Linux, else a socket file beside it."""
        base = self.to_scheduler.removeprefix("ipc://").removesuffix("-in") + "-wake"
        return "\0" + base[1:] if base.startswith("@") else base

    def socket_files(self) -> list[str]:
        """The filesystem paths behind these addresses (none for abstract ones)."""
        paths = [a.removeprefix("ipc://") for a in (self.to_scheduler, self.from_scheduler)]
        return [p for p in (*paths, self.rank_wake_address()) if not p.startswith(("@", "\0"))]
