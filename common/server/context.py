"""What every route module of the node API gets: one ``AppContext`` (built once by ``create_app``)
and the JSON body reader the POST routes share.

Each route module has one ``register(app, ctx)`` that adds its routes; they read the node's config
and reach the scheduler only through ``ctx`` (no module state), so ``create_app`` only assembles.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from common.http_limits import json_too_deep
from common.server.config import ApiConfig
from common.server.errors import bad_request
from common.server.generation import Inflight
from common.server.metrics import ApiMetrics
from common.ipc.scheduler_client import SchedulerClient
from common.server.textio import TokenizerLike

VERSION = "0.1.0"


@dataclass(frozen=True)
class AppContext:
    cfg: ApiConfig
    scheduler: SchedulerClient
    tokenizer: TokenizerLike
    metrics: ApiMetrics
    # client rid -> the request serving it; generation registers, /abort_request looks up.
    registry: dict[str, Inflight]
    started: float  # time.time() when the app was built: /server_info's uptime, /v1/models' created


# A \uD800-\uDFFF escape: only through one can json.loads (of strictly decoded text) produce a
# lone surrogate, which no tokenizer or msgpack encoder downstream accepts.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_json(raw: bytes) -> Any:
    """``raw`` as JSON; a 400 ``ApiError`` when it nests too deep or is not valid JSON. Pure: the
    POST routes run it in a worker thread for a large body."""
    reason = json_too_deep(raw)  # before json.loads recurses: a 100k-deep body was a 500
    if reason is not None:
        raise bad_request(reason)
    try:
        # Strict UTF-8 (RFC 8259); json.loads(bytes) would let encoded surrogates through.
        text = raw.decode("utf-8-sig")
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(text):  # rare: then check every string (pairs are fine)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()
            raise bad_request(f"the body contains an unpaired UTF-16 surrogate ({bad})") from exc
    return body


async def read_json(request: Request) -> tuple[Any, int]:
    """The parsed body and its size in bytes; a 400 ``ApiError`` when it is not valid JSON (the
    size and time limits are the ``BodyLimit`` middleware's, which ``request.body()`` goes through)."""
    raw = await request.body()
    return decode_json(raw), len(raw)
