"""Input limits every HTTP edge shares (the router, the nodes' API, the bootstrap registry):
the defaults, the JSON nesting check, and handing freed heap back to the OS.

Pure standard library: the router and the registry import it without a framework of the
nodes', and each server applies it with its own framework (``common.aio_body`` for aiohttp,
``common.server.limits`` for the nodes' ASGI app).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from itertools import accumulate

# JSON nesting allowed in a body. The deepest legitimate body is a chat request with content
# parts ({"messages": [{"content": [{"image_url": {...}}]}]}: 5 levels); 64 leaves a wide margin
# yet stays far below where a recursive decoder fails (json.loads raises RecursionError near
# 1000 levels, after using C stack per level), so a deep body is a clear 400, never a 500.
MAX_JSON_DEPTH = 64

# The nodes' default body limit: a generous bound on the bytes one prompt token can take in a
# JSON body. A token id is at most 7 digits plus ", "; an English text token is about 4 bytes, a
# CJK one about 1.5 characters of 6 bytes each when \u-escaped. 32 bytes per token is 3-4 times
# those; the floor leaves room for the fields around a short-context prompt. A 128k-context model
# gets 4 MiB.
BYTES_PER_TOKEN = 32
MIN_NODE_BODY_BYTES = 1 << 20

# The router's default. Decoding JSON holds the GIL, worker thread or not (json.loads is one C
# call): 20-25 ms per MB on a busy 2-core machine, so a 4 MB body already stalled /health for
# 80-100 ms. 2 MiB holds a 128k-token prompt as ids (~1 MB) or as text; raise it for longer
# prompts, and accept that stall.
ROUTER_MAX_BODY_BYTES = 2 << 20
# The bootstrap registry's bodies are one RankInfo: a few hundred bytes.
REGISTRY_MAX_BODY_BYTES = 64 << 10

# Slow clients: a request's head (request line and headers) must arrive within HEADER_TIMEOUT_S
# of the connection opening (or of the request's first byte, on a kept-alive connection), and
# its body within BODY_TIMEOUT_S of the head. nginx's defaults are 60 s each; ours are shorter
# because every client of these servers is a program on a fast network. On aiohttp the header
# timeout also closes an idle keep-alive connection (one setting does both there): 20 s outlasts
# the idle expiry of the common client pools (aiohttp 15 s, httpx 5 s), so a pooled client closes
# first and never sends into a connection the server is closing.
HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 60.0

# Connections the kernel completes before the server accepts them (listen(2)'s backlog; Linux
# caps it at net.core.somaxconn, 4096 by default). aiohttp's default is 128: a burst of more
# connections than that fills the accept queue, the kernel ignores the handshakes' last ACKs,
# and those clients, already "connected", wait for SYN-ACK retransmissions: 1 s, then 3 s. 400
# sockets opened at once against the registry measured lifetimes of 2 and 3 s against a 1 s
# header timeout. uvicorn (the nodes' API) defaults to 2048; the router and the registry use it too.
LISTEN_BACKLOG = 2048

# The most samples (OpenAI ``n``) one request may ask for; OpenAI's own API caps n at 128.
MAX_N = 128

# Bodies larger than this are decoded (and, on a node, tokenized) in a worker thread.
INLINE_DECODE_BYTES = 64 << 10


def node_body_limit(context_length: int) -> int:
    """The default body limit of a node serving ``context_length`` tokens per sequence."""
    return max(MIN_NODE_BODY_BYTES, context_length * BYTES_PER_TOKEN)


_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """A reason when ``raw`` nests arrays/objects deeper than ``limit``, else None.

    Runs on the raw bytes, before any decoder recurses. Brackets inside strings do not count.
    The common case (a body with at most ``limit`` opening brackets) is two C-level counts; the
    rest is C-level too (replaces, a split, a translate, an accumulate), linear in the body's size.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return None
    structure = raw
    if b'"' in raw:
        # Drop the strings: escaped backslashes first, then escaped quotes (left to right, as a
        # JSON decoder reads them), then every other piece between quotes.
        structure = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = structure.translate(None, _NOT_BRACKET)
    depth = max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
    if depth <= limit:
        return None
    return f"the body nests JSON arrays/objects {depth} deep; the limit is {limit}"


def _libc_malloc_trim():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS.

    glibc keeps freed memory in the arena of the thread that freed it, and the executor's worker
    threads live on: what a large body decoded and tokenized there freed (the tokenizer's
    buffers, the id lists) stayed as RSS after its 400 (a 20 MB prompt: 2.15 GB after, 0.30 GB
    after a trim). Cheap (milliseconds) next to the work that made the garbage.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
