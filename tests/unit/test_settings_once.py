"""Each setting is declared once, and every flag an operator can pass is documented.

A node's settings live in ``common.config`` (one frozen dataclass per subsystem, composed into
``NodeConfig``), with their defaults there or, for those an environment variable sets, in
``common.envs``. The narrower configs the schedulers, the decode budget and the KV managers take
are views built from those: a default declared again in a view drifts from the real one, so a
view may carry defaults only for values that are not settings (the allowlist below says why each
is not). The flag check reads the parsers themselves, so a flag added without a line in
docs/OPERATIONS.md fails here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from decode_node.admission import DecodeBudgetConfig
from decode_node.scheduler import DecodeSchedConfig
from prefill_node.scheduler import PrefillSchedConfig
from transfer.config import KVManagerConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Defaults a view may keep: fixed parts of a mechanism, with no flag, no env var, no NodeConfig field.
NOT_SETTINGS = {
    KVManagerConfig: {"tick_s"},  # how often the background loops wake to check timers and close()
    DecodeSchedConfig: {"drain_warn_s"},  # how often a long drain is logged
    DecodeBudgetConfig: {"clip_max_new_tokens", "retract_decode_steps"},  # the policy's fixed caps
    PrefillSchedConfig: set(),
}


@pytest.mark.parametrize("view", list(NOT_SETTINGS), ids=lambda c: c.__name__)
def test_views_of_the_node_config_declare_no_defaults_of_their_own(view: type) -> None:
    with_default = {f.name for f in dataclasses.fields(view)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    extra = with_default - NOT_SETTINGS[view]
    assert not extra, (f"{view.__name__} declares defaults for {sorted(extra)}: take them from common.config's "
                       "settings when the view is built (or, if they are not settings, list them here and say why)")


def test_the_kv_manager_view_takes_every_transfer_setting() -> None:
    from common.config import TransferConfig

    tc = TransferConfig(bootstrap_timeout_s=7.0, waiting_timeout_s=8.0, heartbeat_interval_s=0.3,
                        heartbeat_max_failures=5, num_workers=3, max_batch_entries=99, hung_peer_quarantine_s=11.0,
                        max_fence_s=12.0, idle_peer_purge_s=13.0, write_timeout_s=5.0, cluster_secret="s")
    cfg = KVManagerConfig.from_transfer_config(tc)
    for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s", "heartbeat_max_failures",
                 "num_workers", "max_batch_entries", "hung_peer_quarantine_s", "max_fence_s", "idle_peer_purge_s",
                 "cluster_secret"):
        assert getattr(cfg, name) == getattr(tc, name), name
    # A hung peer's quarantine outlasts one blocked engine write, whatever the two settings say.
    assert KVManagerConfig.from_transfer_config(dataclasses.replace(tc, write_timeout_s=30.0)).hung_peer_quarantine_s == 30.0


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from bootstrap_server.__main__ import build_parser as bootstrap
    from decode_node.__main__ import build_parser as decode
    from prefill_node.__main__ import build_parser as prefill
    from router.config import build_parser as router

    return {"prefill": prefill(), "decode": decode(), "router": router(), "bootstrap": bootstrap()}


@pytest.mark.parametrize("command", ["prefill", "decode", "router", "bootstrap"])
def test_every_flag_is_in_operations(command: str) -> None:
    with open(os.path.join(REPO, "docs", "OPERATIONS.md")) as f:
        ops = f.read()
    flags = {o for a in _parsers()[command]._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    missing = sorted(flag for flag in flags if f"`{flag}" not in ops)
    assert not missing, f"pdcluster {command} flags with no line in docs/OPERATIONS.md: {missing}"


def test_each_environment_variable_is_declared_once_and_read_only_there() -> None:
    """``common.envs`` declares every PDC_ variable with its default and doc line; code elsewhere
    reads it through that declaration (``envs.X.get()``), never from ``os.environ`` with a default
    of its own."""
    import re

    from common import envs

    names = [v.name for v in envs.all_vars()]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    direct = re.compile(r"""os\.(?:environ(?:\.get|\.setdefault|\.pop)?\s*[\[(]|getenv\s*\()\s*f?["']PDC_""")
    offenders = []
    for package in ("common", "router", "prefill_node", "decode_node", "transfer", "bootstrap_server"):
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                path = os.path.join(root, name)
                if not name.endswith(".py") or path == os.path.join(REPO, "common", "envs.py"):
                    continue
                with open(path) as f:
                    offenders += [f"{os.path.relpath(path, REPO)}:{i}" for i, line in enumerate(f, 1) if direct.search(line)]
    assert not offenders, f"PDC_ variables read around common.envs: {offenders}"
