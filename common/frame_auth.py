"""Sealed frames: an HMAC-SHA256 tag keyed from the cluster secret, over the payload, a timestamp
and a nonce, for messages that travel over ZMQ rather than HTTP.

    frame = payload || ts (8 bytes, ms, big-endian) || nonce (8 bytes) || tag (32 bytes)
    tag   = HMAC-SHA256(key, payload || ts || nonce)
    key   = HMAC-SHA256(cluster secret, context)

Each channel derives its own key from a context string (the control plane's
``pdcluster/control-plane/v2``, the KV events' ``pdcluster/kv-events/v1``), so a frame of one
channel never opens on another. The receiver checks the tag in constant time before decoding.

Replays: a frame is accepted once, within ``WINDOW_S`` of the receiver's clock. Every nonce
accepted is remembered until its frame expires, so a recorded frame sent again is dropped like a
forged one. The window allows for clock skew between pods; nodes need synchronised clocks (NTP).

What it does not do: encrypt (messages are readable on the wire). The key is derived rather than
the secret used as is, so a tag never doubles as a request token or a proof (common/auth.py).
Stdlib only: the router opens KV-event frames with it (no torch).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict

TAG_BYTES = 32  # SHA-256
_STAMP = struct.Struct(">Q8s")  # ms since the epoch, nonce
OVERHEAD = _STAMP.size + TAG_BYTES
WINDOW_S = 60.0
# Only frames with a valid tag are remembered: this bounds memory against a legitimate rate above
# MAX_NONCES / (2 * WINDOW_S) messages/s per receiving manager, never against a stranger.
MAX_NONCES = 200_000


class FrameAuth:
    def __init__(self, secret: str, context: bytes, window_s: float = WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        if not secret:
            raise ValueError(f"{type(self).__name__} needs a non-empty cluster secret")
        self._key = hmac.new(secret.encode(), context, hashlib.sha256).digest()
        self._window_ms = int(window_s * 1000)
        self._max = max_nonces
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> when it may be forgotten (ms)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<secret>)"

    def seal(self, payload: bytes, now: float | None = None) -> bytes:
        """``payload`` with its stamp and tag appended: what goes on the wire."""
        stamped = payload + _STAMP.pack(int((time.time() if now is None else now) * 1000), os.urandom(8))
        return stamped + hmac.digest(self._key, stamped, "sha256")

    def open(self, frame: bytes, now: float | None = None) -> bytes | None:
        """The payload of a fresh frame whose tag is right, seen for the first time; else None (too
        short, a wrong tag, too old or too far ahead, or a replay)."""
        if len(frame) <= OVERHEAD:
            return None
        stamped, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self._key, stamped, "sha256")):
            return None
        ts_ms, nonce = _STAMP.unpack(stamped[-_STAMP.size:])
        now_ms = int((time.time() if now is None else now) * 1000)
        if abs(now_ms - ts_ms) > self._window_ms:
            return None
        with self._lock:
            while self._seen and (len(self._seen) >= self._max or next(iter(self._seen.values())) < now_ms):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return None
            self._seen[nonce] = ts_ms + self._window_ms
        return stamped[:-_STAMP.size]

