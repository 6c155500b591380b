"""What the router needs to know of a client request, read without a tokenizer, and the 4xx it
can give by itself (the nodes judge everything else: their 4xx reaches the client unchanged).

    endpoint + JSON body -> RequestInfo(stream, sequences, items, key)
      sequences  how many sequences the nodes will run (prompts x n): that many rooms
      items      prompts in a /generate batch (None: a single prompt), for per-item room lists
      key        prompt text the cache-aware policy matches prefixes on
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.pd_contract import all_ints, bootstrap_fields as _contract_fields, is_int

MAX_SEQUENCES = 4096  # per request; the nodes have their own (lower) limit and say so


class RouterError(Exception):
    """A request the router answers itself, with ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RequestInfo:
    stream: bool
    sequences: int
    items: int | None
    key: str | None


def _bad(message: str) -> RouterError:
    return RouterError(400, message)


def _ids_key(ids: list) -> str:
    # A separator after every id keeps prefixes prefixes. Joined in slices: one C-level join of
    # 500k ids held the GIL for 150 ms, and so the event loop, though a large body is inspected
    # in a worker thread (router/app.py); between slices the interpreter may switch threads.
    return "".join([",".join(map(str, ids[i:i + 8192])) + "," for i in range(0, len(ids), 8192)]) or ","


def _n(v: Any, where: str) -> int:
    if v is None:
        return 1
    if not is_int(v) or v < 1:
        raise _bad(f"'{where}' must be a positive integer, got {v!r}")
    return v


def _stream(body: dict) -> bool:
    v = body.get("stream", False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'stream' must be true or false, got {v!r}")
    return v


def _prompts(v: Any, field: str) -> tuple[int | None, str]:
    """(items in a batch or None, key) of a ``text``/``prompt``/``input_ids`` value."""
    if isinstance(v, str):
        return None, v
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return len(v), v[0]
        if all_ints(v):
            return None, _ids_key(v)
        if all(isinstance(p, list) and p and all_ints(p) for p in v):
            return len(v), _ids_key(v[0])
    raise _bad(f"'{field}' must be a string, a non-empty list of strings, a list of token ids or a list of "
               f"token-id lists")


def inspect(endpoint: str, body: Any) -> RequestInfo:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    stream = _stream(body)
    if endpoint == "generate":
        given = [f for f in ("text", "input_ids") if body.get(f) is not None]
        if len(given) != 1:
            raise _bad("give exactly one of 'text' and 'input_ids'")
        items, key = _prompts(body[given[0]], given[0])
        sp = body.get("sampling_params")
        if sp is not None and not isinstance(sp, dict):
            raise _bad("'sampling_params' must be an object")
        n = _n((sp or {}).get("n"), "sampling_params.n")
    elif endpoint == "completions":
        if body.get("prompt") is None:
            raise _bad("'prompt' is required")
        items, key = _prompts(body["prompt"], "prompt")
        n = _n(body.get("n"), "n")
    elif endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise _bad("'messages' must be a non-empty list of message objects")
        items, n = None, _n(body.get("n"), "n")
        key = "".join(f"<{m.get('role')}>{m.get('content') if isinstance(m.get('content'), str) else ''}"
                      for m in msgs)
    else:
        raise ValueError(endpoint)
    sequences = (items or 1) * n
    if sequences > MAX_SEQUENCES:
        raise _bad(f"{sequences} sequences in one request; the router takes at most {MAX_SEQUENCES}")
    return RequestInfo(stream, sequences, items, key)


def bootstrap_fields(info: RequestInfo, host: str, port: int | None, room: int) -> dict:
    """What the router adds to both legs' bodies. A batch of single samples gets one room per
    item (as sglang-router sends them); otherwise one scalar room, which the nodes spread over
    the request's sequences as room + i (the router reserved all of them)."""
    per_item = info.items is not None and info.sequences == info.items
    return _contract_fields(host, port, room, info.items if per_item else None)
