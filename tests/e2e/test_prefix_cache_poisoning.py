"""A write through the Mooncake data plane cannot poison the prefix cache: real processes, the
real Mooncake TCP engine, and an attacker engine in this test process.

The attacker does what anyone on the pod network can (docs/OPERATIONS.md, threat model): it looks
up the prefill's Mooncake session in the bootstrap registry, asks Mooncake's handshake for the
first buffer the prefill registered (the K of layer 0) and overwrites its first pages with
garbage, where an idle pool keeps the prefix cache of the prompt just served. The same prompt
sent again must come back equal to HF greedy token for token, recomputed rather than read from
the poisoned pages, with the prefill's integrity-failure metric counting it; the node ends idle.

The same attacker then writes into a decode's pages while a transfer is in flight: the prefill
stops itself (fault hook) after the first of the room's engine writes (one descriptor each: the
K of layer 0 of the room's pages) and before the aux row that carries the prompt's digest; the
attacker overwrites the decode's layer-0 K pages and the prefill is resumed. The decode must fail
that request (502, never a 200 from the poisoned pages) and count it in its integrity metric; the
same prompt then comes back equal to HF, and both nodes end idle.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.cluster import Cluster, check_greedy, memory, metric, running_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

mooncake = pytest.importorskip("mooncake.engine")

PROMPT = [(13 * k + 7) % 500 + 10 for k in range(70)]  # 4 full pages of 16 and 6 tokens
N = 8
POISONED_PAGES = 16  # pages 1..16 of layer 0's K: the idle pool's first pages, where PROMPT was cached
MID_TRANSFER_ROOM = 2**50 + 26  # the room the prefill stops in (outside next_room()'s range)
DECODE_PROMPT = [(17 * k + 5) % 500 + 10 for k in range(50)]
# One descriptor per engine call, and the stop after the first: the room's layer-0 K landed on the
# decode, its aux row (the digest) not yet. The heartbeat bound (5 s x 4) outlasts the pause.
ENV = {"PDC_FAULT_STOP_BEFORE_WRITE_ROOM": str(MID_TRANSFER_ROOM), "PDC_FAULT_STOP_AFTER_WRITES": "1",
       "PDC_TRANSFER_MAX_BATCH_ENTRIES": "1", "PDC_HEARTBEAT_INTERVAL_S": "5",
       "PDC_LOG_LEVEL": "INFO"}  # INFO: the decode logs its Mooncake session (the attacker would scan for it)
STOP_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str) -> Iterator[Cluster]:
    with running_cluster(tiny_qwen3, decode_args=["--max-total-tokens", "1024"], env=ENV) as c:
        yield c


def generate(cluster: Cluster) -> tuple[list[int], int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    p, d = cluster.pd("/generate", body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    out = d.json()
    return out["output_ids"], int(out["meta_info"]["cached_tokens"])


def page_bytes(cluster: Cluster) -> int:
    info = httpx.get(cluster.prefill.url + "/server_info", timeout=10).json()
    cfg = httpx.get(cluster.prefill.url + "/model_info", timeout=10).json()
    assert info["page_size"] == 16, info
    import json
    import os

    with open(os.path.join(cluster.model_dir, "config.json")) as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    del cfg
    return info["page_size"] * hf["num_key_value_heads"] * head_dim * 4  # float32


def test_garbage_written_into_the_prefills_cached_pages_is_never_served(cluster: Cluster) -> None:
    first, cached = generate(cluster)
    check_greedy(cluster.model_dir, PROMPT, first, N, "before the attack")
    again, cached = generate(cluster)
    assert again == first and cached == 64, cached  # served from the prefix cache
    failures = metric(cluster.prefill.url, "pdc_scheduler_kv_integrity_failures_total")

    routes = httpx.get(f"http://127.0.0.1:{cluster.bootstrap_port}/routes", timeout=10).json()
    session = routes[0]["session_id"]
    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    size = POISONED_PAGES * page_bytes(cluster)
    garbage = ctypes.create_string_buffer(b"\x7f" * size, size)
    assert engine.register_memory(ctypes.addressof(garbage), size) == 0
    target = engine.get_first_buffer_address(session)
    assert target, "the handshake named no buffer"
    offset = page_bytes(cluster)  # page 0 is reserved; the first pages handed out start at 1
    assert engine.batch_transfer_sync_write(session, [ctypes.addressof(garbage)], [target + offset], [size]) == 0

    after, cached = generate(cluster)
    check_greedy(cluster.model_dir, PROMPT, after, N, "after garbage was written into the cached pages")
    assert cached < 64, f"the poisoned prefix was served ({cached} cached tokens)"
    assert metric(cluster.prefill.url, "pdc_scheduler_kv_integrity_failures_total") >= failures + 1
    cluster.wait_idle()


def stopped_pid(group: int) -> int | None:
    """A process of the node's process group that is stopped (SIGSTOP), if any."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] == "T":
            return int(pid)
    return None


def decode_session(cluster: Cluster) -> str:
    with open(cluster.decode.log_path, errors="replace") as f:
        m = re.search(r"decode KV manager up: status \S+, data (\S+)", f.read())
    assert m, "the decode logged no Mooncake session"
    return m.group(1)


def test_garbage_written_into_a_decodes_pages_mid_transfer_is_never_served(cluster: Cluster) -> None:
    failures = metric(cluster.decode.url, "pdc_scheduler_kv_integrity_failures_total")
    total = memory(cluster.decode.url)["total_pages"]
    nbytes = page_bytes(cluster)
    body = {"input_ids": DECODE_PROMPT, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    b = cluster.body(body, room=MID_TRANSFER_ROOM)
    with ThreadPoolExecutor(2) as ex:
        resumed = False
        prefill = ex.submit(httpx.post, cluster.prefill.url + "/generate", json={**b, "stream": True}, timeout=180)
        pd = ex.submit(httpx.post, cluster.decode.url + "/generate", json=b, timeout=180)
        try:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while stopped_pid(cluster.prefill.proc.pid) is None:
                assert not pd.done(), f"the request ended before the prefill stopped: {pd.result().text}"
                assert time.monotonic() < deadline, "the prefill never stopped mid-transfer"
                time.sleep(0.05)
            # The pause: layer 0's K of the room is on the decode, the digest is not. Overwrite every
            # page of the decode's layer-0 K (but the reserved page 0) with garbage.
            engine = mooncake.TransferEngine()
            assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            size = (total - 1) * nbytes
            garbage = ctypes.create_string_buffer(b"\x7f" * size, size)
            assert engine.register_memory(ctypes.addressof(garbage), size) == 0
            session = decode_session(cluster)
            target = engine.get_first_buffer_address(session)
            assert target, "the handshake named no buffer"
            assert engine.batch_transfer_sync_write(session, [ctypes.addressof(garbage)], [target + nbytes], [size]) == 0
            os.killpg(cluster.prefill.proc.pid, signal.SIGCONT)
            resumed = True
            d = pd.result(timeout=120)
            prefill.result(timeout=120)  # its answer is moot: the decode judges what arrived
        finally:
            if not resumed:
                os.killpg(cluster.prefill.proc.pid, signal.SIGCONT)
    assert d.status_code == 502 and "KV integrity check failed" in d.text, (d.status_code, d.text)
    assert metric(cluster.decode.url, "pdc_scheduler_kv_integrity_failures_total") >= failures + 1
    p_again, d_again = cluster.pd("/generate", cluster.body(body))  # the pages are whole again once rewritten
    assert p_again.status_code == 200 and d_again.status_code == 200, d_again.text
    check_greedy(cluster.model_dir, DECODE_PROMPT, d_again.json()["output_ids"], N, "after the poisoned transfer")
    cluster.wait_idle()


def listeners(group: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of the node's process group (the
    ``ss -ltnp`` view, read from /proc so no tool is needed)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != group:
                    continue
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
            for fam in ("tcp", "tcp6"):
                with open(f"/proc/{pid}/net/{fam}") as f:
                    for line in list(f)[1:]:
                        cols = line.split()
                        if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                            addr, port = cols[1].split(":")
                            out.append((int(pid), addr, int(port, 16)))
        except (OSError, ValueError):
            continue  # a process that exited meanwhile
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net writes them


def test_only_mooncake_listens_beyond_host(cluster: Cluster) -> None:
    """With --host 127.0.0.1 every listener of our own (HTTP, registry, ZMQ control and events) is
    on loopback. Mooncake's two ports per engine are the documented exception (docs/OPERATIONS.md
    §7: 0.3.13.post1 binds 0.0.0.0 and [::] and has no setting against it); if a release fixes
    that, this test says so and the threat model must change."""
    for node in (cluster.prefill, cluster.decode):
        socks = listeners(node.proc.pid)
        assert socks, f"{node.name}: no listening socket found"
        wide = [(pid, addr, port) for pid, addr, port in socks if addr not in LOOPBACK]
        per_pid: dict[int, int] = {}
        for pid, _, port in wide:
            assert 15000 <= port <= 17000, f"{node.name}: a non-Mooncake port listens beyond loopback: {wide}"
            per_pid[pid] = per_pid.get(pid, 0) + 1
        assert wide and all(n == 2 for n in per_pid.values()), (node.name, wide)
