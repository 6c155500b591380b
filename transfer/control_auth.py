"""Authenticity and freshness of control-plane messages: an HMAC-SHA256 tag keyed from the
cluster secret, over the payload, a timestamp and a nonce.

    frame = msgpack payload || ts (8 bytes, ms, big-endian) || nonce (8 bytes) || tag (32 bytes)
    tag   = HMAC-SHA256(key, payload || ts || nonce)
    key   = HMAC-SHA256(cluster secret, "pdcluster/control-plane/v2")

Both channels carry it (decode -> prefill and prefill -> decode) once a secret is configured;
the receiver checks the tag in constant time before decoding, so a message from a peer without
the secret never reaches a handler and changes no state: it is dropped and logged (rate-limited)
and the serving thread goes on. Without a secret frames are the bare payload, as before; a node
with a secret and one without cannot talk (each drops the other's frames as malformed or
unauthenticated), and the heartbeat turns that into failed rooms rather than a hang.

Replays: a frame is accepted once, within ``WINDOW_S`` of the receiver's clock. Every nonce
accepted is remembered until its frame expires, so a recorded ``AbortRoom``, ``TransferInfo`` or
status sent again is dropped like a forged one (counted the same way). The window allows for
clock skew between pods; nodes need synchronised clocks (NTP), as every TLS stack does.

What it does not do: encrypt (messages are readable on the wire). The key is derived rather
than the secret used as is, so a tag never doubles as a request token or a proof (common/auth.py).
Cost: one HMAC over a few hundred bytes per message and a dict lookup. The frame format and the
checks are ``common/frame_auth.py``'s (the KV events use them too, under a key of their own).
"""
from __future__ import annotations

from common.frame_auth import MAX_NONCES, OVERHEAD, TAG_BYTES, WINDOW_S, FrameAuth

__all__ = ["MAX_NONCES", "OVERHEAD", "TAG_BYTES", "WINDOW_S", "ControlAuth", "control_auth"]

_CONTEXT = b"pdcluster/control-plane/v2"


class ControlAuth(FrameAuth):
    def __init__(self, secret: str, window_s: float = WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        super().__init__(secret, _CONTEXT, window_s, max_nonces)


def control_auth(secret: str | None) -> ControlAuth | None:
    return ControlAuth(secret) if secret else None
