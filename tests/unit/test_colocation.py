"""The co-located-node detection (common/colocation.py) against a fake /proc."""
from __future__ import annotations

from pathlib import Path

from common.colocation import busy_neighbours, node_role, warning_text


def _proc(root: Path, pid: int, ppid: int, argv: list[str], cores: str, threads: int = 1) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "status").write_text(f"Name:\tpython\nPPid:\t{ppid}\nThreads:\t{threads}\nCpus_allowed_list:\t{cores}\n")


SPAWN = ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]


def test_node_role_recognises_both_launch_forms() -> None:
    assert node_role(["/venv/bin/pdcluster", "decode", "--port", "1"]) == "decode"
    assert node_role(["python", "-m", "prefill_node", "--model-path", "x"]) == "prefill"
    assert node_role(["pdcluster", "router"]) is None
    assert node_role(["python", "-m", "pytest", "prefill"]) is None


def test_other_nodes_scheduler_on_our_cores_is_reported(tmp_path: Path) -> None:
    _proc(tmp_path, 10, 1, ["pdcluster", "prefill"], "0-1")  # our API process
    _proc(tmp_path, 11, 10, SPAWN, "0-1")  # us, its scheduler
    _proc(tmp_path, 12, 10, SPAWN, "0-1")  # our node's other child (resource tracker): ours
    _proc(tmp_path, 20, 1, ["python", "-m", "decode_node"], "0-1")  # the other node
    _proc(tmp_path, 21, 20, SPAWN, "1,3", threads=5)  # its scheduler: shares core 1
    _proc(tmp_path, 22, 20, SPAWN, "0-3", threads=2)  # its resource tracker: fewer threads, not reported
    _proc(tmp_path, 30, 1, ["python", "-m", "http.server"], "0-1")  # not a node
    _proc(tmp_path, 31, 30, SPAWN, "0-1")
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    found = busy_neighbours({0, 1}, proc=tmp_path, self_pid=11)
    assert [(n.pid, n.node_pid, n.role, n.cores, n.threads) for n in found] == [(21, 20, "decode", (1,), 5)]
    text = warning_text(found, 2, 2)  # default threads: every core, next to another node
    assert text is not None and "--cpu-threads" in text and "decode node pid 20" in text
    assert warning_text(found, 1, 2) is None  # the split `pdcluster up` gives: one core each


def test_disjoint_cores_or_lone_node_give_no_warning(tmp_path: Path) -> None:
    _proc(tmp_path, 10, 1, ["pdcluster", "prefill"], "0")
    _proc(tmp_path, 11, 10, SPAWN, "0")
    _proc(tmp_path, 20, 1, ["pdcluster", "decode"], "0-1")
    _proc(tmp_path, 21, 20, SPAWN, "1")  # pinned to the other core
    assert busy_neighbours({0}, proc=tmp_path, self_pid=11) == []
    assert warning_text([], 1, 1) is None


def test_real_proc_scan_finds_no_node_for_this_test_process() -> None:
    import os

    found = busy_neighbours(set(os.sched_getaffinity(0)))
    assert all(n.pid != os.getpid() for n in found)


def test_a_real_dummy_node_and_its_child_are_found_in_proc() -> None:
    import os
    import subprocess
    import sys
    import time

    # argv ends "pdcluster prefill": /proc shows it as a prefill node's API process; its child
    # (a sleeping python) stands for the scheduler.
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    node = subprocess.Popen([sys.executable, "-c", code, "pdcluster", "prefill"], stdout=subprocess.PIPE, text=True)
    child = -1
    try:
        assert node.stdout is not None
        child = int(node.stdout.readline())
        mine = set(os.sched_getaffinity(0))
        deadline = time.monotonic() + 10
        found: list = []
        while time.monotonic() < deadline and not found:
            found = [n for n in busy_neighbours(mine) if n.node_pid == node.pid]
            time.sleep(0.05)
        assert [(n.pid, n.role) for n in found] == [(child, "prefill")]
        assert set(found[0].cores) == mine & set(os.sched_getaffinity(child))
    finally:
        for pid in (child, node.pid):
            if pid > 0:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        node.wait(timeout=10)
        if node.stdout is not None:
            node.stdout.close()
