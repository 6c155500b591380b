"""The router's part of a request's stage timeline (common/timeline.py has the nodes' part).

The router measures, on its own monotonic clock, when it took the request, when it sent both
legs (after picking the pair) and when the decode's final answer came in. Around the decode
node's timeline (which adds up to the decode's own span) it puts::

    router_pick   arrival -> both legs sent (queue, pick, retries)
    decode_hop    the router's view of the decode leg minus the decode's own total: HTTP both ways
    <decode>      api_in, prealloc, kv_transfer, first_token, decode, api_out (the decode node's;
                  a request sent to the decode alone has local_prefill for prealloc + kv_transfer)
    router_out    final answer in -> written to the client (rewriting it included)

so the stages add up to the router's end-to-end time. The prefill's timeline (bootstrap, queue,
forward, transfer) runs inside the decode's prealloc + kv_transfer (but for the end of its
transfer, which it sees a little after the decode may have) and is nested as ``prefill``. Only
durations cross hosts: no clock of one process is compared with another's.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ROUTER_STAGES = ("router_pick", "decode_hop", "router_out")


@dataclass
class Marks:
    """Monotonic marks of one request in the router."""

    arrival: float
    sent: float = 0.0  # both legs on their way (the try that answered)


def compose(marks: Marks, final_in: float, decode: dict, prefill: dict | None) -> dict:
    """The whole request's timeline from the decode's (and the prefill's) node timelines."""
    now = time.monotonic()
    d_total = float(decode.get("total_ms", 0.0))
    stages = {"router_pick": _ms(marks.sent - marks.arrival),
              "decode_hop": round(max(_ms(final_in - marks.sent) - d_total, 0.0), 3)}
    stages.update({f"decode.{k}": v for k, v in decode.get("stages_ms", {}).items()})
    stages["router_out"] = _ms(now - final_in)
    out = {"e2e_ms": _ms(now - marks.arrival), "stages_ms": stages, "decode": decode}
    if prefill is not None:
        out["prefill"] = prefill
    return out


def rewrite_body(raw: bytes, marks: Marks, final_in: float, prefill_answer: object,
                 observe: Callable[[dict], None]) -> bytes:
    """A whole (non-streamed) answer with each sequence's node timeline replaced by the
    composed one; anything without a timeline passes through byte for byte."""
    if b'"timeline"' not in raw:
        return raw
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if _rewrite(body, marks, final_in, prefill_answer, observe):
        return json.dumps(body).encode()
    return raw


def rewrite_frames(frames: bytes, marks: Marks, prefill_answer: object, observe: Callable[[dict], None]) -> bytes:
    """SSE frames with the final event's node timeline replaced (streams carry it once)."""
    if b'"timeline"' not in frames:
        return frames
    final_in = time.monotonic()
    out = []
    for event in frames.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"timeline"' in event:
            try:
                obj = json.loads(event[6:])
            except ValueError:
                out.append(event)
                continue
            if _rewrite(obj, marks, final_in, prefill_answer, observe):
                event = b"data: " + json.dumps(obj).encode()
        out.append(event)
    return b"\n\n".join(out)


def _rewrite(body: object, marks: Marks, final_in: float, prefill_answer: object,
             observe: Callable[[dict], None]) -> bool:
    changed = False
    for holder, index in _timeline_holders(body):
        prefill = _prefill_timeline(prefill_answer, index)
        composed = compose(marks, final_in, holder["timeline"], prefill)
        holder["timeline"] = composed
        observe(composed)
        changed = True
    return changed


def _timeline_holders(body: object) -> Iterator[tuple[dict, int]]:
    """(dict that holds a node "timeline", sequence index): native meta_info or OpenAI choices."""
    items = body if isinstance(body, list) else [body]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict) and isinstance(meta.get("timeline"), dict) and "role" in meta["timeline"]:
            yield meta, int(item.get("index", i))
        for choice in item.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("timeline"), dict) and "role" in choice["timeline"]:
                yield choice, int(choice.get("index", 0))


def _prefill_timeline(answer: object, index: int) -> dict | None:
    """The prefill's node timeline for sequence ``index`` (its /generate answer, or choices)."""
    items = answer if isinstance(answer, list) else [answer]
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        meta = item.get("meta_info")
        if isinstance(meta, dict) and int(item.get("index", i)) == index and isinstance(meta.get("timeline"), dict):
            return meta["timeline"]
        for choice in item.get("choices") or ():
            if isinstance(choice, dict) and int(choice.get("index", 0)) == index and isinstance(choice.get("timeline"), dict):
                return choice["timeline"]
    return None


def _ms(s: float) -> float:
    return round(s * 1000.0, 3)
