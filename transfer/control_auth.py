"""Authenticity of control-plane messages: an HMAC-SHA256 tag keyed from the cluster secret.

    frame = msgpack payload || HMAC-SHA256(key, payload)          (32-byte tag, one ZMQ frame)
    key   = HMAC-SHA256(cluster secret, "pdcluster/control-plane/v1")

Both channels carry it (decode -> prefill and prefill -> decode) once a secret is configured;
the receiver checks the tag in constant time before decoding, so a message from a peer without
the secret never reaches a handler and changes no state: it is dropped and logged (rate-limited)
and the serving thread goes on. Without a secret frames are the bare payload, as before; a node
with a secret and one without cannot talk (each drops the other's frames as malformed or
unauthenticated), and the heartbeat turns that into failed rooms rather than a hang.

What it does not do: encrypt (messages are readable on the wire) or stop replays (a recorded
message is valid again; ours are idempotent or name a room/session whose state rejects a
stale copy). The key is derived rather than the secret used as is, so a tag never doubles as
proof of the HTTP bearer token. Cost: one HMAC over a few hundred bytes per message.
"""
from __future__ import annotations

import hashlib
import hmac

TAG_BYTES = 32  # SHA-256
_CONTEXT = b"pdcluster/control-plane/v1"


class ControlAuth:
    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("ControlAuth needs a non-empty cluster secret")
        self._key = hmac.new(secret.encode(), _CONTEXT, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ControlAuth(<secret>)"

    def seal(self, payload: bytes) -> bytes:
        """``payload`` with its tag appended: what goes on the wire."""
        return payload + hmac.digest(self._key, payload, "sha256")

    def open(self, frame: bytes) -> bytes | None:
        """The payload of a frame whose tag is right, else None (too short, or a wrong tag)."""
        if len(frame) <= TAG_BYTES:
            return None
        payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, hmac.digest(self._key, payload, "sha256")):
            return None
        return payload


def control_auth(secret: str | None) -> ControlAuth | None:
    return ControlAuth(secret) if secret else None
