"""PrefillProcess start-up failures release what was already built (tiny model, fake data plane,
in-memory bootstrap registry; no network besides loopback ZMQ)."""
from __future__ import annotations

import threading

import pytest
import zmq

import transfer
from common.config import NodeConfig, resolve
from common.protocol import IpcEndpoints
from prefill_node.launch import build_parser, config_from_args
from prefill_node.process import PrefillOptions, PrefillProcess
from tests.unit.test_transfer_fake_flow import MemoryBootstrap
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


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> list[TrackedPlane]:
    TrackedPlane.built = []
    monkeypatch.setattr(transfer, "create_data_plane", lambda *a, **kw: TrackedPlane())
    return TrackedPlane.built


def test_data_plane_is_closed_when_the_manager_cannot_start(tiny_qwen3: str, tracked: list[TrackedPlane],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "HttpBootstrapClient", RefusingBootstrap)
    with pytest.raises(transfer.TransferError, match="bootstrap server not up"):
        PrefillProcess(node_config(tiny_qwen3), PrefillOptions(), IpcEndpoints.fresh(), BOOT)
    (plane,) = tracked
    assert plane.closed


def test_manager_is_closed_when_a_later_part_cannot_start(tiny_qwen3: str, tracked: list[TrackedPlane],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    boot = MemoryBootstrap()
    monkeypatch.setattr(transfer, "HttpBootstrapClient", lambda: boot)
    bad = IpcEndpoints(to_scheduler="ipc:///nonexistent-dir/pdc-in", from_scheduler="ipc:///nonexistent-dir/pdc-out")
    with pytest.raises(zmq.ZMQError):  # NodeIO cannot bind its socket
        PrefillProcess(node_config(tiny_qwen3), PrefillOptions(), bad, BOOT)
    (plane,) = tracked
    assert plane.closed
    assert boot.registries[BOOT].layout() is None, "the rank is deregistered"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pdc-")], "transfer threads stopped"

