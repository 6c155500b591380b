"""``python -m common.tools.bench_transfer`` on a tiny layout (smoke test), and the bench's byte-moving helpers.

The smoke test runs the real CLI in its own process group (the bench spawns the decode child);
expected descriptor counts and byte sizes are computed here from the layout, not by the bench.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from common.tools import bench_transfer_peer as peer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None

# 2 layers x (K, V) = 4 buffers; a token is 2 heads x 16 dims x 2 bytes = 64 bytes per buffer.
LAYERS, HEADS, DIM, DTYPE_BYTES, TOKENS = 2, 2, 16, 2, 60
BUFFERS, TOKEN_BYTES = 2 * LAYERS, HEADS * DIM * DTYPE_BYTES


def run_bench(tmp_path: Path, methods: list[str], timeout_s: float = 60) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "common.tools.bench_transfer", "--layers", str(LAYERS), "--kv-heads", str(HEADS),
           "--head-dim", str(DIM), "--dtype-bytes", str(DTYPE_BYTES), "--tokens", str(TOKENS),
           "--page-sizes", "1,16", "--iterations", "2", "--single-iteration-above", "100",
           "--methods", ",".join(methods), "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the decode child goes with it
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"bench did not finish within {timeout_s}s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"bench exited {proc.returncode}:\n{stderr[-3000:]}"
    return json.loads(out.read_text()), stdout


def test_bench_smoke(tmp_path: Path) -> None:
    methods = ["sender", "sender-fake", "mooncake-raw", "socket", "memcpy"] if HAVE_MOONCAKE else ["sender-fake", "socket", "memcpy"]
    report, stdout = run_bench(tmp_path, methods)
    rows = report["results"]
    assert [(r["page_size"], r["fragmentation"], r["method"]) for r in rows] == [
        (ps, frag, m) for ps in (1, 16) for frag in ("contiguous", "scattered") for m in methods]
    for r in rows:
        pages = -(-TOKENS // r["page_size"])  # whole pages move, the last one partly filled
        runs = 1 if r["fragmentation"] == "contiguous" else pages  # reversed destination: nothing merges
        kv_desc = runs * BUFFERS
        where = f"{r['page_size']}/{r['fragmentation']}/{r['method']}"
        assert r["pages"] == pages and r["bytes"] == pages * r["page_size"] * TOKEN_BYTES * BUFFERS, where
        assert r["kv_descriptors"] == kv_desc, where
        # The sender path adds one descriptor: the aux row (first token) on the last chunk.
        assert r["descriptors"] == kv_desc + (r["method"].startswith("sender")), where
        assert r["iterations"] == (1 if kv_desc > 100 else 2), where
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["max"] < 30_000, where
        if r["method"] == "sender-fake":
            assert r["verified"] is None and r["gbps"] is None, where
        else:
            assert r["verified"] is True, where
            assert r["gbps"] == pytest.approx(r["bytes"] / (lat["p50"] / 1e3) / 1e9), where
        if r["method"].startswith("sender"):
            assert r["handshake_ms"] > 0 and r["batches"] >= 1, where
    assert report["command"].startswith("python -m common.tools.bench_transfer --layers 2")
    assert report["machine"]["cpus"] >= 1 and len(report["machine"]["loadavg_before"]) == 3
    table = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    assert len(table) == len(rows) + 1  # header + one line per result


def test_scatter_gather_socket_matches_reference() -> None:
    """More ranges than IOV_MAX, odd sizes, a tiny receive buffer (many partial reads)."""
    rng = np.random.default_rng(0)
    n = peer.IOV_MAX * 2 + 37
    lens = rng.integers(1, 300, size=n).astype(np.int64)
    src = rng.integers(0, 256, size=int(lens.sum()) * 2, dtype=np.uint8)
    dst = np.zeros_like(src)
    # Source ranges packed from 0; destination ranges in reverse order with gaps of 3 bytes.
    src_off = np.concatenate(([0], np.cumsum(lens)[:-1]))
    dst_off = np.empty(n, dtype=np.int64)
    pos = 0
    for k in reversed(range(n)):
        dst_off[k], pos = pos + 3, pos + 3 + int(lens[k])
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.settimeout(10)  # a bug that loses bytes fails here instead of hanging
    b.settimeout(10)
    sender = threading.Thread(target=peer.send_views, args=(a, peer.make_views(memoryview(src), src_off, lens)))
    try:
        sender.start()
        peer.recv_views(b, peer.make_views(memoryview(dst), dst_off, lens))
        sender.join(10)
    finally:
        a.close()
        b.close()
    expected = np.zeros_like(src)
    for k in range(n):
        expected[dst_off[k]:dst_off[k] + lens[k]] = src[src_off[k]:src_off[k] + lens[k]]
    assert np.array_equal(dst, expected)


def test_pattern_and_digest_catch_misplaced_pages() -> None:
    layout = peer.BenchLayout(LAYERS, HEADS, DIM, DTYPE_BYTES, TOKENS)
    ps = 4
    flat = torch.empty(layout.capacity([ps]), dtype=torch.uint8)
    peer.fill_pattern(flat)
    words = flat.view(torch.int64)
    assert torch.unique(words).numel() == words.numel()  # no two 8-byte words alike
    pages = list(range(1, layout.request_pages(ps) + 1))
    base = peer.digest(flat, layout, ps, pages)
    assert len(base) == BUFFERS and len(set(base)) == BUFFERS
    swapped = pages[:]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    assert peer.digest(flat, layout, ps, swapped) != base
    flat[layout.buffer_nbytes(ps) + 5 * layout.page_nbytes(ps) + 7] ^= 1  # one bit, buffer 1, page 5
    changed = peer.digest(flat, layout, ps, pages)
    assert [i for i in range(BUFFERS) if changed[i] != base[i]] == [1]
