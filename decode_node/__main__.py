"""Launch a decode node: ``pdcluster decode ...`` or ``python -m decode_node ...``.

Two processes: this one serves HTTP (the shared API app) and starts the scheduler process,
linked by two ZMQ ipc sockets; the shared launcher (``common.node.launch.node_main``) builds the
config from the flags and runs them. This module adds the decode's flags and its role part
(``decode_node.process``). HTTP is served only once the scheduler reported ready (model loaded,
pools and KV manager up); a start-up failure exits with status 1 and the reason. If the
scheduler dies later the API process shuts down too (status 1), so a supervisor sees one failed
node instead of a zombie half.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from common.config import ConfigError, NodeConfig, SchedulerConfig
from common.node.launch import add_kv_events_flags, add_node_flags, node_main, role_config
from decode_node.process import DecodePart


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdcluster decode", description="run a decode node (API + scheduler)")
    add_node_flags(p, port=30001)
    p.add_argument("--num-reserved-decode-tokens", type=int, default=SchedulerConfig.reserved_decode_tokens,
                   help="KV headroom kept per running request when admitting new rooms")
    p.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="scales the decode headroom ratio (new_token_ratio); < 1 admits more rooms and retracts more")
    p.add_argument("--stream-interval", type=int, default=SchedulerConfig.stream_interval,
                   help="a streamed request's tokens go out every N decode steps (first token and end at once); "
                        "N > 1 trades smoothness for less work per token in this node, the router and the client")
    p.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true",
                   help="keep finished requests' KV (prompt + output, whole pages) in a prefix cache on this node: "
                        "a later request that starts with it (the next turn of a conversation) has only the rest "
                        "of its prompt's KV sent (decode_prefix_len); off by default, as in SGLang; ignored for "
                        "models with recurrent state")
    add_kv_events_flags(p)  # published only with the prefix cache on
    return p


def _sched_config(conservativeness: float, reserved_decode_tokens: int, stream_interval: int) -> SchedulerConfig:
    """SGLang's --schedule-conservativeness: both ends of the new_token_ratio schedule scale with it."""
    if conservativeness <= 0:
        raise ConfigError(f"--schedule-conservativeness must be > 0, got {conservativeness}")
    base = SchedulerConfig()
    init = min(base.new_token_ratio_init * conservativeness, 1.0)
    return replace(base, new_token_ratio_init=init, new_token_ratio_min=min(base.new_token_ratio_min * conservativeness, init),
                   reserved_decode_tokens=reserved_decode_tokens, stream_interval=stream_interval)


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    return role_config("decode", a, prefix_cache=a.disaggregation_decode_enable_radix_cache,
                       sched=_sched_config(a.schedule_conservativeness, a.num_reserved_decode_tokens, a.stream_interval))


def _part(cfg: NodeConfig, _ns: argparse.Namespace) -> DecodePart:
    return DecodePart(cfg.sched, cfg.transfer, cfg.cache.max_running_requests, kv_events=cfg.kv_events)


def main(argv: list[str] | None = None) -> int:
    return node_main("decode", argv, build_parser(), config_from_args, _part, log_tag="decode-api",
                     exit_with_scheduler=True)


if __name__ == "__main__":
    sys.exit(main())
