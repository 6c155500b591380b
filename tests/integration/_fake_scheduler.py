"""A stand-in scheduler process for API-process tests: real ZMQ ipc sockets, no model.

    python tests/integration/_fake_scheduler.py --to-scheduler ipc://... --from-scheduler ipc://...
        --log PATH --alphabet 11,12,13 [--role decode|prefill] [--step-s 0.005]

Behaviour (deterministic, so tests can predict every token):
  - GenerateReq: token k of a request is ``alphabet[(sum(input_ids) + k) % len(alphabet)]``, one per
    step; it finishes with "stop" (matched id) when a token is in ``stop_token_ids``, else with
    "length" after ``max_new_tokens``. Logprob of token k is ``-0.01 * (k + 1)``; its top
    alternatives are the next alphabet entries with lower logprobs.
  - role prefill: no tokens; after one step the request finishes with length 0 (KV "sent").
  - ``bootstrap_room % 1000 == 503``: the transfer "fails": finish abort + error + http_status 503.
  - AbortReq: finish abort for a known rid; unknown rids are ignored.
  - QueryReq load/memory/metrics and FlushCacheReq: fixed-shape payloads from the live state.
Every decoded message is appended as one JSON line to ``--log`` (tests read what arrived).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgspec
import zmq

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from common.ipc.protocol import (  # noqa: E402
    AbortReq,
    BatchOutput,
    FlushCacheReq,
    GenerateReq,
    QueryReply,
    QueryReq,
    ReqOutput,
    decode_to_scheduler,
    encode,
)
from common.request import FinishReason  # noqa: E402

FAIL_ROOM_MOD = 503


def token_at(alphabet: list[int], input_ids: list[int], k: int) -> int:
    return alphabet[(sum(input_ids) + k) % len(alphabet)]


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.alphabet = [int(x) for x in args.alphabet.split(",")]
        self.role = args.role
        self.step_s = args.step_s
        self.log = open(args.log, "a", buffering=1)
        ctx = zmq.Context()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(args.to_scheduler)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(args.from_scheduler)
        self.running: dict[str, tuple[GenerateReq, int]] = {}  # rid -> (req, tokens produced)
        self.flushes = 0

    def record(self, msg: object) -> None:
        self.log.write(json.dumps(msgspec.to_builtins(msg)) + "\n")

    def handle(self, buf: bytes, out: list[ReqOutput]) -> None:
        msg = decode_to_scheduler(buf)
        if msg is None:
            self.log.write(json.dumps({"type": "malformed"}) + "\n")
            return
        self.record(msg)
        if isinstance(msg, GenerateReq):
            room = msg.bootstrap_room
            if room is not None and room % 1000 == FAIL_ROOM_MOD:
                reason = f"KV transfer failed for room {room} (rid {msg.rid}): prefill peer unreachable"
                out.append(ReqOutput(rid=msg.rid, finish=FinishReason(type="abort", message=reason),
                                     prompt_tokens=len(msg.input_ids), error=reason, http_status=503))
            else:
                self.running[msg.rid] = (msg, 0)
        elif isinstance(msg, AbortReq):
            if self.running.pop(msg.rid, None) is not None:
                out.append(ReqOutput(rid=msg.rid, finish=FinishReason(type="abort", message="aborted")))
        elif isinstance(msg, FlushCacheReq):
            ok = not self.running
            self.flushes += ok
            self.push.send(encode(QueryReply(query_id=msg.query_id, payload={
                "success": ok, "message": "flushed" if ok else "requests are running"})))
        elif isinstance(msg, QueryReq):
            self.push.send(encode(QueryReply(query_id=msg.query_id, payload=self.query(msg.what))))

    def query(self, what: str) -> dict:
        if what == "load":
            return {"num_reqs": len(self.running), "num_waiting_reqs": 0,
                    "num_tokens": sum(len(r.input_ids) + k for r, k in self.running.values())}
        if what == "memory":
            return {"free_pages": 100, "used_pages": len(self.running), "flushes": self.flushes}
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": 0, "token_usage": 0.25,
                "gen_throughput": 12.5, "not_a_number": "x"}

    def step(self, out: list[ReqOutput]) -> None:
        for rid, (req, k) in list(self.running.items()):
            n_prompt = len(req.input_ids)
            if self.role == "prefill":
                del self.running[rid]
                out.append(ReqOutput(rid=rid, finish=FinishReason(type="length", length=0),
                                     prompt_tokens=n_prompt))
                continue
            tid = token_at(self.alphabet, req.input_ids, k)
            k += 1
            finish = None
            if tid in req.sampling.stop_token_ids:
                finish = FinishReason(type="stop", matched=tid)
            elif k >= req.sampling.max_new_tokens:
                finish = FinishReason(type="length", length=k)
            lp = top = None
            if req.sampling.return_logprob:
                lp = [-0.01 * k]
                top = [[(self.alphabet[(self.alphabet.index(tid) + j) % len(self.alphabet)], -0.01 * k - j)
                        for j in range(req.sampling.top_logprobs_num)]]
            out.append(ReqOutput(rid=rid, new_token_ids=[tid], new_logprobs=lp, new_top_logprobs=top,
                                 finish=finish, prompt_tokens=n_prompt, completion_tokens=k, cached_tokens=1))
            if finish is None:
                self.running[rid] = (req, k)
            else:
                del self.running[rid]

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while True:
            out: list[ReqOutput] = []
            timeout_ms = int(self.step_s * 1000) if self.running else 100
            if poller.poll(timeout_ms):
                while True:
                    try:
                        buf = self.pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(buf, out)
            if self.running:
                time.sleep(self.step_s)
                self.step(out)
            if out:
                self.push.send(encode(BatchOutput(items=out)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--to-scheduler", required=True)
    p.add_argument("--from-scheduler", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--alphabet", required=True)
    p.add_argument("--role", default="decode", choices=("decode", "prefill"))
    p.add_argument("--step-s", type=float, default=0.005)
    Fake(p.parse_args()).run()


if __name__ == "__main__":
    main()
