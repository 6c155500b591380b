"""Launch a prefill node: ``pdcluster prefill ...`` or ``python -m prefill_node ...``.

::

    pdcluster prefill --model-path DIR [--host H --port P --disaggregation-bootstrap-port B
                      --disaggregation-transfer-backend mooncake|fake --page-size N ...]

    this process                                       child (spawned)
    ------------                                       ---------------
    1. BootstrapServer on B (thread)   <-- PUT /route --  PrefillKVManager registers its rank
    2. spawn scheduler, wait for "ready" <-- pipe -----   model loaded, pools built, rank registered
    3. uvicorn: FastAPI app  <== ZMQ ipc (common.ipc) ==>  scheduler loop
    4. on exit: SIGTERM the scheduler (SIGKILL after a grace period), stop the bootstrap server

The shared launcher (``common.node.launch.node_main``) builds the config from the flags and does
steps 2-4; this module adds the prefill's flags, its role part and the registry. ``/health``
stays 503 until the scheduler has answered, and turns 503 again if it dies (the API watches its
pid; the registry's ``/health`` too): the node stays up, so its decode peers hear of the death
from the registry.
"""
from __future__ import annotations

import argparse
import logging
import sys

from common.config import NodeConfig, SchedulerConfig
from common.node.launch import SchedulerChild, StartupError, add_kv_events_flags, add_node_flags, node_main, role_config
from prefill_node.process import PrefillPart

log = logging.getLogger("prefill_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster prefill", description="Run a prefill node (flags mirror SGLang's).")
    d = "(default: %(default)s)"
    add_node_flags(p, port=30000)
    p.add_argument("--chunked-prefill-size", type=int, default=SchedulerConfig.chunked_prefill_size,
                   help=f"most prompt tokens of one request per forward; <= 0 disables chunking {d}")
    p.add_argument("--max-prefill-tokens", type=int, default=SchedulerConfig.max_prefill_tokens,
                   help=f"most prompt tokens per forward {d}")
    p.add_argument("--schedule-policy", default="fcfs", choices=("fcfs", "lpm"), help=f"waiting queue order {d}")
    p.add_argument("--compute-ahead-fraction", type=float, default=SchedulerConfig.compute_ahead_fraction,
                   help="share of the KV pool that prompts computed before their decode has said where to "
                        f"write them may hold; 0: compute a prompt only once its decode has answered {d}")
    p.add_argument("--disable-radix-cache", action="store_true", help="turn the prefix cache off")
    add_kv_events_flags(p)
    return p


def config_from_args(ns: argparse.Namespace) -> NodeConfig:
    return role_config("prefill", ns, prefix_cache=not ns.disable_radix_cache,
                       sched=SchedulerConfig(chunked_prefill_size=ns.chunked_prefill_size,
                                             max_prefill_tokens=ns.max_prefill_tokens, schedule_policy=ns.schedule_policy,
                                             compute_ahead_fraction=ns.compute_ahead_fraction))


class Registry:
    """The bootstrap registry this node embeds, on ``--disaggregation-bootstrap-port``; its
    ``/health`` follows the scheduler's."""

    def __init__(self, host: str, port: int, child: SchedulerChild, secret: str | None) -> None:
        from bootstrap_server.server import BootstrapServer

        self.host, self.port = host, port
        self.server = BootstrapServer(host, port, health_check=child.alive, secret=secret)

    def start(self) -> None:
        try:
            self.server.start()
        except OSError as exc:
            raise StartupError(f"cannot serve the bootstrap registry on {self.host}:{self.port}: {exc}") from exc
        log.info("bootstrap registry on %s:%d", self.host, self.port)

    def stop(self) -> None:
        self.server.stop()


def _part(cfg: NodeConfig, ns: argparse.Namespace) -> PrefillPart:
    from bootstrap_server.client import bootstrap_url

    tc = cfg.transfer
    return PrefillPart(cfg.sched, tc, bootstrap_url(ns.host, tc.bootstrap_port), kv_events=cfg.kv_events)


def _registry(cfg: NodeConfig, ns: argparse.Namespace, child: SchedulerChild) -> Registry:
    return Registry(ns.host, cfg.transfer.bootstrap_port, child, cfg.transfer.cluster_secret)


def main(argv: list[str] | None = None) -> int:
    return node_main("prefill", argv, build_parser(), config_from_args, _part, log_tag="prefill", sidecar=_registry)


if __name__ == "__main__":
    sys.exit(main())
