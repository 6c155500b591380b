"""Decode node launch glue: flags -> config, start-up failures, the advertised host."""
from __future__ import annotations

import pytest

from common.config import ConfigError, resolve
from decode_node.__main__ import build_parser, config_from_args, main
from common.node.process import advertise_host


def parse(model: str, *flags: str):  # type: ignore[no-untyped-def]
    return resolve(config_from_args(build_parser().parse_args(["--model-path", model, *flags])))


def test_flags_mirror_sglang_and_fill_the_config(tiny_qwen3: str) -> None:
    cfg = parse(tiny_qwen3, "--port", "31999", "--page-size", "32", "--max-running-requests", "7",
                      "--disaggregation-transfer-backend", "fake", "--max-total-tokens", "4096",
                      "--num-reserved-decode-tokens", "64")
    assert cfg.role == "decode" and cfg.server.port == 31999
    assert cfg.cache.page_size == 32 and cfg.cache.max_running_requests == 7 and cfg.cache.max_total_tokens == 4096
    assert cfg.cache.enable_prefix_cache is False  # received KV is never cached on the decode node
    assert cfg.transfer.backend == "fake" and cfg.sched.reserved_decode_tokens == 64
    assert cfg.model.device == "cpu" and cfg.model.dtype == "float32"  # "auto" resolved


def test_schedule_conservativeness_scales_the_ratio_schedule(tiny_qwen3: str) -> None:
    base = parse(tiny_qwen3)
    low = parse(tiny_qwen3, "--schedule-conservativeness", "0.5")
    high = parse(tiny_qwen3, "--schedule-conservativeness", "10")
    assert low.sched.new_token_ratio_init == pytest.approx(base.sched.new_token_ratio_init / 2)
    assert low.sched.new_token_ratio_min == pytest.approx(base.sched.new_token_ratio_min / 2)
    assert high.sched.new_token_ratio_init == 1.0 and high.sched.new_token_ratio_min <= 1.0
    with pytest.raises(ConfigError):
        parse(tiny_qwen3, "--schedule-conservativeness", "0")


def test_bad_flags_exit_2_with_the_flag_named(tiny_qwen3: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-path", "/nonexistent/model"]) == 2
    assert "--model-path" in capsys.readouterr().err
    assert main(["--model-path", tiny_qwen3, "--page-size", "12"]) == 2
    assert "--page-size" in capsys.readouterr().err
    assert main(["--model-path", tiny_qwen3, "--num-reserved-decode-tokens", "0"]) == 2


def test_advertised_host_is_never_a_wildcard() -> None:
    assert advertise_host("10.1.2.3") == "10.1.2.3"
    assert advertise_host("127.0.0.1") == "127.0.0.1"
    for wildcard in ("0.0.0.0", "", "::"):
        host = advertise_host(wildcard)
        assert host not in ("0.0.0.0", "", "::") and host.count(".") == 3


def test_startup_failure_after_the_manager_closes_it(tiny_qwen3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part built after the transfer manager fails (here the IPC socket cannot bind): the
    manager's threads stop and the data plane is closed, not leaked."""
    import threading

    import zmq

    import transfer.factory
    from common.ipc.protocol import IpcEndpoints
    from common.node.process import NodeProcess
    from decode_node.process import DecodePart
    from transfer.backends.fake import FakeDataPlane

    closed: list[bool] = []

    class Plane(FakeDataPlane):
        def close(self) -> None:
            closed.append(True)
            super().close()

    monkeypatch.setattr(transfer.factory, "create_data_plane", lambda *a, **kw: Plane())
    cfg = parse(tiny_qwen3, "--disaggregation-transfer-backend", "fake", "--max-total-tokens", "256")
    bad = IpcEndpoints(to_scheduler="ipc:///nonexistent-dir/pdc-in", from_scheduler="ipc:///nonexistent-dir/pdc-out")
    with pytest.raises(zmq.ZMQError):
        NodeProcess(cfg, DecodePart(cfg.sched, cfg.transfer, cfg.cache.max_running_requests), bad)
    assert closed == [True]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pdc-")]
