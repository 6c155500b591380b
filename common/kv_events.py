"""KV events: what a node's prefix cache holds, told to whoever routes on it (docs/PROTOCOL.md §7).

A node's radix cache publishes, per scheduler step, one ``KVEventBatch`` of events about
page-aligned token blocks; a router keeps a per-worker set of block hashes from them and predicts
the cache hit of a prompt before choosing a worker::

    stored   blocks that entered the cache, in prefix order, after ``parent_hash``
    removed  blocks that left it (eviction, a dropped branch)
    cleared  everything left it (/flush_cache)

**Block hashes are chained**: block i of a token sequence is named by
``H(hash of block i-1, token ids of block i)`` (block 0 by ``H(ROOT_HASH, ...)``), 64 bits of
BLAKE2b over the parent hash and the ids as little-endian uint32. A block's hash therefore names
its whole prefix: two prompts share block i's hash only if they share blocks 0..i, so a router
finds a prompt's cached prefix by hashing its blocks and counting how many leading hashes a worker
holds, without keeping token ids. Deterministic across processes and machines (no Python
``hash()``, whose salt differs per process), so every router and every node computes the same
names; the block size is the node's page size, carried in every batch and snapshot.

**Sequence numbers** order the batches of one publisher instance (``instance_id``, new at every
scheduler start): each batch with events is ``seq + 1`` of the one before; a batch without
events is a heartbeat carrying the current ``seq``. A subscriber that sees a ``seq`` jump has lost
a batch (PUB drops for a slow subscriber) and starts again from the node's snapshot
(``KVSnapshot``: every stored block and the ``seq`` it includes); a ``seq`` it has already seen is a
replay and is dropped; a new ``instance_id`` is a restarted node (start again, from nothing).

On the wire each batch is one msgpack-encoded tagged struct per ZMQ message, sealed with the
cluster secret when there is one (``common/frame_auth.py``, a key of its own: a control-plane
frame never opens here). Stdlib and msgspec only: the router imports this without torch.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from common.frame_auth import FrameAuth

# msgspec bounds must fit an int64, so only the sign is checked; it decodes at most uint64 anyway.
U64 = Annotated[int, msgspec.Meta(ge=0)]
ROOT_HASH = int.from_bytes(hashlib.blake2b(b"pdcluster/kv-block/v1", digest_size=8).digest(), "little")
EVENTS_CONTEXT = b"pdcluster/kv-events/v1"
# Largest frame a subscriber takes (ZMQ drops bigger ones before they are read): a batch of one
# step's events is far smaller; this only bounds what a hostile publisher can make us allocate.
MAX_FRAME_BYTES = 64 << 20
HEARTBEAT_S = 1.0  # an idle publisher still sends this often, so a subscriber notices silence

_STRUCT_OPTS = dict(tag_field="type", kw_only=True)  # unknown fields are ignored: newer publishers may add some


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the whole blocks of ``token_ids`` (a partial last block has none),
    continuing after the block named ``parent``."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    ids = array("I", token_ids[: n * block_size])  # OverflowError for an id outside uint32
    if sys.byteorder != "little":
        ids.byteswap()
    raw = memoryview(ids).cast("B")
    step = 4 * block_size
    out, h = [], parent
    for i in range(n):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(raw[i * step : (i + 1) * step])
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


# ---- the messages --------------------------------------------------------------------------------


class BlockStored(msgspec.Struct, tag="stored", **_STRUCT_OPTS):
    parent_hash: U64 | None  # None: the first block starts at the root (no prefix)
    block_hashes: list[U64]  # in prefix order: each one's parent is the one before


class BlockRemoved(msgspec.Struct, tag="removed", **_STRUCT_OPTS):
    block_hashes: list[U64]


class AllCleared(msgspec.Struct, tag="cleared", **_STRUCT_OPTS):
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared


class KVEventBatch(msgspec.Struct, tag="kv_events", **_STRUCT_OPTS):
    instance_id: str  # the publishing scheduler process; new at every start
    seq: Annotated[int, msgspec.Meta(ge=0)]  # this batch's number; a heartbeat repeats the last one
    block_size: Annotated[int, msgspec.Meta(ge=1)]  # tokens per block (the node's page size)
    role: Literal["prefill", "decode"]  # whose cache (the decode's may publish the same events)
    ts: float  # publisher's time.time(), for lag metrics only
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, tag="kv_snapshot", **_STRUCT_OPTS):
    """Every block the cache holds once every batch up to ``seq`` is applied (GET /kv_events/snapshot)."""

    instance_id: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    role: Literal["prefill", "decode"]
    blocks: list[U64]


class KVEventsInfo(msgspec.Struct, kw_only=True):
    """What ``/server_info`` says under ``kv_events``: where to subscribe."""

    endpoint: str  # tcp://host:port of the PUB socket
    host: str
    port: int
    instance_id: str
    block_size: int
    sealed: bool  # frames carry the cluster secret's tag


# ---- encoding and sealing ------------------------------------------------------------------------


class Malformed(ValueError):
    """A frame that did not open (no or a wrong tag, stale, replayed) or does not decode."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "unauthenticated" | "malformed": the drop counter's label


class EventCodec:
    """Batches to frames and back; sealed with ``secret`` (None: bare payloads). One per socket end:
    the opening side remembers nonces, so a replayed frame does not open twice."""

    def __init__(self, secret: str | None) -> None:
        self._auth = FrameAuth(secret, EVENTS_CONTEXT) if secret else None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(KVEventBatch)

    @property
    def sealed(self) -> bool:
        return self._auth is not None

    def encode(self, batch: KVEventBatch) -> bytes:
        payload = self._enc.encode(batch)
        return payload if self._auth is None else self._auth.seal(payload)

    def decode(self, frame: bytes) -> KVEventBatch:
        """The batch in ``frame``; ``Malformed`` naming why not."""
        payload = frame
        if self._auth is not None:
            opened = self._auth.open(frame)
            if opened is None:
                raise Malformed("unauthenticated", "a frame without a valid, fresh tag of the cluster secret")
            payload = opened
        try:
            return self._dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Malformed("malformed", f"not a KV event batch: {exc}") from exc


_SNAPSHOT_JSON = msgspec.json.Decoder(KVSnapshot)


def decode_snapshot(raw: bytes) -> KVSnapshot:
    """``GET /kv_events/snapshot``'s body; ``Malformed`` if it is not one."""
    try:
        return _SNAPSHOT_JSON.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Malformed("malformed", f"not a KV snapshot: {exc}") from exc
