"""``python -m tests.chaos``: a chaos run (``make chaos``) or a soak (``--soak-s``); prints the
figures, exits 1 unless clean."""
from __future__ import annotations

import argparse
import sys
import tempfile

from common.tools.make_tiny_model import make_tiny_model


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", help="a checkpoint (default: a fresh tiny qwen3)")
    p.add_argument("--soak-s", type=float, default=0.0, help="run a soak of this many seconds instead")
    a = p.parse_args()
    model = a.model_path or make_tiny_model(tempfile.mkdtemp(prefix="pdc-chaos-model-"), "qwen3")
    logdir = tempfile.mkdtemp(prefix="pdc-chaos-")
    print(f"model {model}; node logs in {logdir}", flush=True)
    if a.soak_s:
        from tests.chaos.soak import run_soak

        report = run_soak(model, logdir, a.soak_s, a.concurrency)
    else:
        from tests.chaos.driver import run_chaos

        report = run_chaos(model, logdir, a.requests, a.concurrency, a.seed)
    print(report.table())
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
