"""common/node/launch.py ``node_main``: both roles' ``main`` go flags -> config -> ``run_node``
through it; what each role hands ``run_node`` (its part, its sidecar, whether the node exits
with its scheduler) is checked here without starting a process."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import decode_node.__main__ as decode_main
import prefill_node.__main__ as prefill_main
from common.node import launch
from decode_node.process import DecodePart
from prefill_node.process import PrefillPart


@pytest.fixture
def run_node(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(cfg: Any, api_cfg: Any, part: Any, **kw: Any) -> int:
        calls.append({"cfg": cfg, "api_cfg": api_cfg, "part": part, **kw})
        return 0

    monkeypatch.setattr(launch, "run_node", fake)
    return calls


MAINS: dict[str, Callable[[list[str]], int]] = {"prefill": prefill_main.main, "decode": decode_main.main}


@pytest.mark.parametrize("role", MAINS)
def test_a_bad_flag_exits_2_before_anything_runs(role: str, run_node: list[dict[str, Any]], tiny_qwen3: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert MAINS[role](["--model-path", tiny_qwen3, "--page-size", "12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdcluster {role}: ") and "--page-size" in err
    assert run_node == []


def test_the_decode_runs_its_part_and_exits_with_its_scheduler(run_node: list[dict[str, Any]], tiny_qwen3: str) -> None:
    assert decode_main.main(["--model-path", tiny_qwen3, "--max-running-requests", "5", "--stream-interval", "3"]) == 0
    (call,) = run_node
    part, cfg = call["part"], call["cfg"]
    assert isinstance(part, DecodePart) and cfg.role == part.role == "decode"
    assert part.max_running_requests == 5 and part.sched.stream_interval == 3 and part.transfer == cfg.transfer
    assert call["exit_with_scheduler"] is True and call["sidecar"] is None


def test_the_prefill_runs_its_part_beside_its_registry(run_node: list[dict[str, Any]], tiny_qwen3: str) -> None:
    flags = ["--model-path", tiny_qwen3, "--host", "127.0.0.1", "--disaggregation-bootstrap-port", "18998",
             "--cluster-secret", "0123456789abcdef-secret", "--chunked-prefill-size", "64"]
    assert prefill_main.main(flags) == 0
    (call,) = run_node
    part, cfg = call["part"], call["cfg"]
    assert isinstance(part, PrefillPart) and cfg.role == part.role == "prefill"
    assert part.sched.chunked_prefill_size == 64 and part.bootstrap_url.endswith("127.0.0.1:18998")
    assert call["exit_with_scheduler"] is False
    child = SimpleNamespace(alive=lambda: True)
    registry = call["sidecar"](child)  # built with the child it runs beside; not started here
    assert isinstance(registry, prefill_main.Registry)
    assert (registry.host, registry.port) == ("127.0.0.1", 18998)
    assert cfg.transfer.cluster_secret == registry.server._server._secret == "0123456789abcdef-secret"
