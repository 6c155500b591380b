"""``pdcluster up``: a whole cluster on this machine — prefill and decode nodes with our router in
front — for a first run, a demo or local development.

    pdcluster up [--model-path DIR] [--port 8000] [--num-prefill N] [--num-decode M] [--demo]
                 [--api-key KEY] [--cluster-secret SECRET]

Without ``--model-path`` it makes a tiny random-weight model (its text is noise; the tests check
the tokens against HF). It prints the router's URL, the one address clients need, and runs until
Ctrl-C or SIGTERM, then stops every child by process group. ``--demo`` sends one chat request
through the router, prints the answer and both kinds of node's memory report, and shuts down.

Secure by default: without ``--cluster-secret`` (or ``PDC_CLUSTER_SECRET``) it makes one for this
run, and an operator key for the router unless ``--operator-key`` / ``PDC_OPERATOR_KEY`` names
one. Each is written (mode 0600) to a run directory of its own (mode 0700) and handed to the
children in their environment: a node, the registry and the control plane answer only the router
and each other, and adding or draining workers, ``/flush_cache`` and ``/abort_request`` need the
operator key (workers only on this machine). ``--insecure`` runs everything open instead. The
router's client key stays off unless ``--api-key`` (or ``PDC_API_KEY``) is given.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import urllib.request

from common import envs
from common.auth import SecretError, is_loopback, resolve_secret
from common.tools.local_cluster import ROUTERS, LocalCluster, get_json


def post_json(url: str, body: dict, timeout_s: float = 120, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # runs the finally below: the children are stopped, not orphaned


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdcluster up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF checkpoint directory (default: a tiny random-weight qwen3 model)")
    ap.add_argument("--host", default="127.0.0.1", help="the router's listen address (nodes stay on loopback)")
    ap.add_argument("--port", type=int, default=8000, help="the router's port")
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks per prefill node (--tp-size)")
    ap.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks per decode node (--tp-size)")
    ap.add_argument("--policy", default="least-loaded", help="router policy (see `pdcluster router --help`)")
    ap.add_argument("--router", default="ours", choices=ROUTERS,
                    help="the front door: ours, sglang (sglang-router from .venv-router, `make router-venv`), none")
    ap.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "fake"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--demo", action="store_true", help="send one request through the router, print the answer, shut down")
    ap.add_argument("--prompt", default="Disaggregated serving splits prefill and decode because")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--api-key", help="clients of the router must send 'Authorization: Bearer KEY' (default: PDC_API_KEY)")
    ap.add_argument("--cluster-secret", help="nodes, registry and control plane require it (default: PDC_CLUSTER_SECRET, "
                    "else one made for this run)")
    ap.add_argument("--operator-key", help="the router's operator endpoints need it (default: PDC_OPERATOR_KEY, "
                    "else one made for this run)")
    ap.add_argument("--insecure", action="store_true", help="no cluster secret and no operator key: everything "
                    "answers anyone who can reach it")
    args = ap.parse_args(argv)
    try:
        args.api_key = resolve_secret(args.api_key, None, envs.API_KEY, "--api-key")
        args.operator_key = resolve_secret(args.operator_key, None, envs.OPERATOR_KEY, "--operator-key")
        args.cluster_secret = resolve_secret(args.cluster_secret, None, envs.CLUSTER_SECRET, "--cluster-secret")
    except SecretError as exc:
        ap.error(str(exc))
    if args.insecure and (args.cluster_secret or args.operator_key):
        ap.error("--insecure runs without a cluster secret or operator key: drop one of them")
    if args.num_prefill < 1 or args.num_decode < 1:
        ap.error("--num-prefill and --num-decode must be >= 1")
    if args.demo and args.router == "none":
        ap.error("--demo sends its request through a router: drop --router none")
    return args


def run_secret(run_dir: str, name: str) -> str:
    """A new secret, also written to ``run_dir/name`` readable by its owner only."""
    secret = secrets.token_hex(32)
    path = os.path.join(run_dir, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def tiny_model_dir() -> str:
    from common.tools.make_tiny_model import make_tiny_model  # torch: only when needed

    path = os.path.join(tempfile.gettempdir(), "pdcluster-demo-tiny-qwen3")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_model(path, arch="qwen3", seed=0)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    model = args.model_path or tiny_model_dir()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    run_dir = tempfile.mkdtemp(prefix="pdcluster-up-")  # 0700
    secret, operator_key = args.cluster_secret, args.operator_key
    if not args.insecure:
        if secret is None:
            secret = run_secret(run_dir, "cluster-secret")
            print(f"cluster secret: made for this run, in {os.path.join(run_dir, 'cluster-secret')} (0600)", flush=True)
        if operator_key is None and args.router == "ours":
            operator_key = run_secret(run_dir, "operator-key")
            print(f"operator key  : made for this run, in {os.path.join(run_dir, 'operator-key')} (0600)", flush=True)
    cluster = LocalCluster(cluster_secret=secret, api_key=args.api_key, operator_key=operator_key)
    router_args = ["--policy", args.policy, "--worker-allow", "127.0.0.1", "--worker-allow", "localhost",
                   "--worker-allow", "[::1]"] if args.router == "ours" else []
    if args.insecure and args.router == "ours" and not is_loopback(args.host):
        router_args.append("--insecure")
    try:
        url = cluster.start(model, backend=args.transfer_backend, page_size=args.page_size,
                            num_prefill=args.num_prefill, num_decode=args.num_decode,
                            prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, router=args.router,
                            router_args=router_args, router_port=args.port, router_host=args.host,
                            startup_timeout_s=args.startup_timeout)
        for n in cluster.nodes:
            extra = f" (bootstrap port {n.bootstrap_port})" if n.bootstrap_port else ""
            print(f"{n.role} node {n.url}{extra}", flush=True)
        if url:
            print(f"router  {url}   <- send requests here (OpenAI API and /generate)", flush=True)
        if not args.demo:
            print("cluster up; Ctrl-C to stop", flush=True)
            while not cluster.dead():
                time.sleep(1)
            print(f"pdcluster up: {', '.join(cluster.dead())} exited; stopping the rest", file=sys.stderr)
            return 1
        body = {"model": None, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_new_tokens, "temperature": 0}
        out = post_json(f"{url}/v1/chat/completions", body, headers=cluster.headers())
        note = "  (random weights: the text is noise; make test checks the tokens against HF)" if args.model_path is None else ""
        print("request :", args.prompt)
        print("answer  :", json.dumps(out["choices"][0]["message"]["content"]) + note)
        print("usage   :", json.dumps(out.get("usage")))
        for n in cluster.nodes:
            print(f"memory  : {n.name:<9}", json.dumps(get_json(n.url + "/debug/memory",
                                                                                  headers=cluster.node_headers("GET", n.url + "/debug/memory"))))
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
