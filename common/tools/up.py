"""``pdcluster up``: a prefill node and a decode node on this machine, for a first run.

With ``--demo`` it makes a tiny random-weight model when none is given, sends one request the
way ``sglang-router`` does (the same body, plus bootstrap host/port/room, to both nodes at
once), prints the decode node's answer and the memory report of both nodes, and shuts down.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request

from common.tools.pair import LaunchedPair, get_json


def post_json(url: str, body: dict, timeout_s: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def pd_request(prefill: str, decode: str, bootstrap_port: int, path: str, body: dict) -> dict:
    """Send one request to both nodes as sglang-router does; return the decode node's body."""
    body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=random.getrandbits(63))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post_json, prefill + path, dict(body, stream=False))
        d = pool.submit(post_json, decode + path, body)
        p.result()
        return d.result()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # runs the finally below: the nodes are stopped, not orphaned


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdcluster up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF checkpoint directory (default with --demo: a tiny random model)")
    ap.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "fake"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--demo", action="store_true", help="send one request, print the answer, shut down")
    ap.add_argument("--prompt", default="Disaggregated serving splits prefill and decode because")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    model = args.model_path
    if model is None:
        if not args.demo:
            print("pdcluster up: --model-path is required (or --demo for a tiny random model)", file=sys.stderr)
            return 2
        from common.tools.make_tiny_model import make_tiny_model

        model = os.path.join(tempfile.gettempdir(), "pdcluster-demo-tiny-qwen3")
        if not os.path.isfile(os.path.join(model, "config.json")):
            make_tiny_model(model, arch="qwen3", seed=0)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    pair = LaunchedPair()
    try:
        t = pair.start(model, args.transfer_backend, args.page_size, [], [], args.startup_timeout)
        print(f"prefill node {t.prefill} (bootstrap port {t.bootstrap_port}), decode node {t.decode}", flush=True)
        if not args.demo:
            print("cluster up; Ctrl-C to stop", flush=True)
            while all(p.poll() is None for p in pair.procs):
                time.sleep(1)
            return 1
        body = {"model": None, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_new_tokens, "temperature": 0}
        out = pd_request(t.prefill, t.decode, t.bootstrap_port, "/v1/chat/completions", body)
        note = "  (random weights: the text is noise; make test checks the tokens against HF)" if args.model_path is None else ""
        print("request :", args.prompt)
        print("answer  :", json.dumps(out["choices"][0]["message"]["content"]) + note)
        print("usage   :", json.dumps(out.get("usage")))
        print("memory  : prefill", json.dumps(get_json(t.prefill + "/debug/memory")))
        print("          decode ", json.dumps(get_json(t.decode + "/debug/memory")))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        pair.stop()

if __name__ == "__main__":
    sys.exit(main())
