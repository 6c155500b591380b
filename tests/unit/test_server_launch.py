"""The API process's scheduler-liveness check must see a dead, unreaped child as dead."""
from __future__ import annotations

import subprocess
import sys
import time

from common.server.launch import pid_alive


def test_zombie_child_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        alive = pid_alive(child.pid)
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:  # exits at once, stays a zombie (not reaped)
            time.sleep(0.05)
        assert not alive()
    finally:
        child.kill()
        child.wait()
    assert not alive()


def test_live_process_counts_as_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid)()
    finally:
        child.kill()
        child.wait()
