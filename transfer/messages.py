"""Every control-plane message of the transfer layer (ZMQ, msgpack, tagged msgspec structs).

Two channels, each one single-frame msgpack message per ZMQ message:

    decode PUSH --> prefill PULL   ToPrefill = KVArgsRegister | TransferInfo | AbortRoom | Ping
    prefill PUSH --> decode PULL   ToDecode  = TransferStatus | Pong

``KVArgsRegister`` is sent once per (decode rank, prefill rank) pair and cached by the prefill under
the decode's data-plane ``session_id``; every later message names that session. Unknown fields are
ignored so a newer peer can add fields without breaking an older one.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from typing import Union

import msgspec


class KVArgsRegister(msgspec.Struct, tag="kv_args", kw_only=True):
    """Where a decode rank's buffers live (its data-plane address space), sent once per peer."""

    session_id: str  # data-plane session of the decode engine, e.g. "host:rpc_port"
    instance_id: str  # unique per decode manager instance: a restart is a new instance
    status_endpoint: str  # tcp://host:port of the decode's status PULL socket
    tp_rank: int
    tp_size: int
    page_size: int
    kv_ptrs: list[int]  # one per buffer, transfer order (K layers, then V layers)
    kv_nbytes: list[int]
    kv_item_nbytes: list[int]  # bytes of one page in each buffer
    aux_ptrs: list[int]
    aux_nbytes: list[int]
    aux_item_nbytes: list[int]  # bytes of one aux row
    state_ptrs: list[int] = []
    state_nbytes: list[int] = []
    state_item_nbytes: list[int] = []
    # The model's KV heads (0: an older decode, equal TP only); with tp_rank/tp_size the prefill
    # derives the heads this rank holds and what it must send it (transfer.tp_map).
    total_kv_heads: int = 0
    # The decode's registered staging area (transfer.staging), where head slices land when this
    # rank holds more heads than a source sends; 0 bytes: none.
    staging_ptr: int = 0
    staging_nbytes: int = 0


class TransferInfo(msgspec.Struct, tag="transfer_info", kw_only=True):
    """Where one room's KV must land on one decode rank."""

    room: int
    session_id: str
    instance_id: str
    status_endpoint: str
    dst_pages: list[int]  # the room's decode pages, in token order
    aux_slot: int | None
    state_slots: list[int] = []
    required_dst_info_num: int = 1  # decode ranks the prefill must hear from before sending
    # The prompt this decode holds the room for (``prompt_digest``); the prefill writes only into
    # a room whose prompt is the one it computes. "" (an older peer): not checked.
    prompt_digest: str = ""
    # The room's pages in the decode's staging area, as (first staging page, count) extents in
    # token order; empty when its head slices land straight in dst_pages (transfer.staging).
    staging: list[tuple[int, int]] = []
    # Tokens of the prompt whose KV the decode already holds (its own prefix cache), a whole
    # number of pages: ``dst_pages`` (and ``staging``) start at that token, and the prefill
    # writes only the pages past it. 0 (an older peer, or no reuse): the whole prompt.
    decode_prefix_len: int = 0


class AbortRoom(msgspec.Struct, tag="abort", kw_only=True):
    """The decode gave up on a room; the prefill answers with a fenced TransferStatus(Failed)."""

    room: int
    session_id: str
    status_endpoint: str
    reason: str


class Ping(msgspec.Struct, tag="ping", kw_only=True):
    """Decode -> prefill heartbeat; answered by Pong on the status channel."""

    seq: int
    session_id: str
    status_endpoint: str


class TransferStatus(msgspec.Struct, tag="status", kw_only=True):
    """Prefill -> decode: a room's terminal outcome on one prefill rank."""

    room: int
    status: int  # KVPoll value: Success or Failed
    prefill_rank: int
    reason: str | None = None
    unregistered: bool = False  # the prefill has no KV args for the session: register again


class Pong(msgspec.Struct, tag="pong", kw_only=True):
    seq: int
    endpoint: str  # the prefill control endpoint the Ping was sent to
    instance_id: str  # changes when the prefill restarts


def prompt_digest(token_ids: Sequence[int]) -> str:
    """What binds a room to its prompt on both nodes: SHA-256 of the token ids (int64, little
    endian), 128 bits in hex. Both roles tokenize the same body alike, so equal prompts agree."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()[:32]


ToPrefill = Union[KVArgsRegister, TransferInfo, AbortRoom, Ping]
ToDecode = Union[TransferStatus, Pong]

_encoder = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


def encode(msg: ToPrefill | ToDecode) -> bytes:
    return _encoder.encode(msg)


def decode_to_prefill(data: bytes) -> ToPrefill:
    """Raises msgspec.DecodeError / msgspec.ValidationError on a malformed message."""
    return _to_prefill.decode(data)


def decode_to_decode(data: bytes) -> ToDecode:
    """Raises msgspec.DecodeError / msgspec.ValidationError on a malformed message."""
    return _to_decode.decode(data)
