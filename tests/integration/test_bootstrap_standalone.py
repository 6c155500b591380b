"""``python -m bootstrap_server`` as a real process: start, serve the client, stop on SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ports import free_port
from bootstrap_server.client import bootstrap_url, health, lookup_layout, lookup_rank, register_rank
from bootstrap_server.schema import DecodeLayout, RankInfo, check_receivable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def launch(port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, "-m", "bootstrap_server", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_standalone_server_serves_the_client_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    url = bootstrap_url("127.0.0.1", port)
    log = tmp_path / "bootstrap.log"
    proc = launch(port, log)
    try:
        deadline = time.monotonic() + 20
        while not health(url, timeout_s=0.5):
            assert proc.poll() is None, f"server exited with {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"no /health within 20 s: {log.read_text()}"
            time.sleep(0.05)

        entry = RankInfo(
            rank_ip="127.0.0.1", rank_port=17000, engine_rank=0, tp_size=1, dp_size=1, dp_group=0, pp_size=1,
            pp_rank=0, page_size=16, kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
            transfer_backend="fake",
        )
        register_rank(url, entry)
        assert lookup_rank(url, engine_rank=0, dp_group=0, timeout_s=2) == entry
        layout = lookup_layout(url, timeout_s=2)
        check_receivable(
            layout,
            DecodeLayout(tp_size=1, pp_size=1, page_size=16, kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8),
        )

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log.read_text()
        assert "listening on" in log.read_text()
        assert health(url) is False
    finally:
        kill(proc)


def test_busy_port_exits_with_an_error(tmp_path: Path) -> None:
    log = tmp_path / "bootstrap.log"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = launch(busy.getsockname()[1], log)
        try:
            assert proc.wait(timeout=20) == 1
        finally:
            kill(proc)
    assert "cannot listen on" in log.read_text()
