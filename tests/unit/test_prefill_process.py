"""The prefill's node process: start-up failures release what was already built, and the built
scheduler refuses what the model cannot hold (tiny model, fake data plane, in-memory bootstrap
registry; no network besides loopback ZMQ)."""
from __future__ import annotations

import pathlib
import threading

import pytest
import zmq

import transfer
import transfer.bootstrap
import transfer.factory
from common.config import NodeConfig, resolve
from common.ipc.protocol import GenerateReq, IpcEndpoints
from common.request import SamplingParams
from common.node.process import NodeProcess
from prefill_node.__main__ import build_parser, config_from_args
from prefill_node.process import PrefillPart
from tests.unit.transfer_harness import MemoryBootstrap
from transfer.backends.fake import FakeDataPlane

BOOT = "127.0.0.1:1"


class TrackedPlane(FakeDataPlane):
    built: list[TrackedPlane] = []

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__()
        self.closed = False
        TrackedPlane.built.append(self)

    def close(self) -> None:
        self.closed = True
        super().close()


class RefusingBootstrap(MemoryBootstrap):
    def register_rank(self, url: str, info: object) -> None:  # type: ignore[override]
        raise ConnectionRefusedError("bootstrap server not up")


def node_config(model: str) -> NodeConfig:
    ns = build_parser().parse_args(["--model-path", model, "--disaggregation-transfer-backend", "fake",
                                    "--max-total-tokens", "256", "--page-size", "16", "--context-length", "40"])
    return resolve(config_from_args(ns))


def prefill_process(cfg: NodeConfig, endpoints: IpcEndpoints) -> NodeProcess:
    return NodeProcess(cfg, PrefillPart(cfg.sched, cfg.transfer, BOOT), endpoints)


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> list[TrackedPlane]:
    TrackedPlane.built = []
    monkeypatch.setattr(transfer.factory, "create_data_plane", lambda *a, **kw: TrackedPlane())
    return TrackedPlane.built


def test_data_plane_is_closed_when_the_manager_cannot_start(tiny_qwen3: str, tracked: list[TrackedPlane],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer.bootstrap, "HttpBootstrapClient", RefusingBootstrap)
    with pytest.raises(transfer.TransferError, match="bootstrap server not up"):
        prefill_process(node_config(tiny_qwen3), IpcEndpoints.fresh())
    (plane,) = tracked
    assert plane.closed


def test_manager_is_closed_when_a_later_part_cannot_start(tiny_qwen3: str, tracked: list[TrackedPlane],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    boot = MemoryBootstrap()
    monkeypatch.setattr(transfer.bootstrap, "HttpBootstrapClient", lambda: boot)
    bad = IpcEndpoints(to_scheduler="ipc:///nonexistent-dir/pdc-in", from_scheduler="ipc:///nonexistent-dir/pdc-out")
    with pytest.raises(zmq.ZMQError):  # NodeIO cannot bind its socket
        prefill_process(node_config(tiny_qwen3), bad)
    (plane,) = tracked
    assert plane.closed
    assert boot.registries[BOOT].layout() is None, "the rank is deregistered"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pdc-")], "transfer threads stopped"


def test_prompts_of_the_context_length_are_refused_before_any_pool(tiny_qwen3: str, tracked: list[TrackedPlane],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: pathlib.Path) -> None:
    """The row holds whole pages (48 tokens here) but the model's context is 40: a prompt of 40
    tokens leaves no room for a token and is refused like the API would."""
    boot = MemoryBootstrap()
    monkeypatch.setattr(transfer.bootstrap, "HttpBootstrapClient", lambda: boot)
    proc = prefill_process(node_config(tiny_qwen3), IpcEndpoints.fresh(str(tmp_path)))
    try:
        sched = proc.scheduler
        assert sched.memory.req_to_token.max_context_len == 48 and sched.cfg.context_len == 40
        out = sched.step([GenerateReq(rid=f"r{n}", input_ids=[1] * n, sampling=SamplingParams(max_new_tokens=1))
                          for n in (39, 40, 48)])
        status = {o.rid: o.http_status for o in out}
        assert status == {"r39": None, "r40": 400, "r48": 400}
        assert "context length 40" in next(o.error for o in out if o.rid == "r40")  # type: ignore[operator]
    finally:
        proc.close()
