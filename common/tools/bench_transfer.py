"""``python -m common.tools.bench_transfer``: move one request's KV between two processes, five
ways, side by side.

This process plays the prefill, a child (``common.tools.bench_transfer_peer``) the decode. For
every page size and fragmentation, one request's pages (all layers, K and V) go over::

    sender        PrefillKVManager/KVSender -> mooncake -> DecodeKVManager/KVReceiver: the real
                  path (bootstrap lookup, ZMQ control plane, run merging, worker thread, status)
    sender-fake   the same path on the fake data plane: control plane only, no bytes move
    mooncake-raw  batch_transfer_sync_write with the same descriptors, nothing around it
    socket        a plain loopback TCP socket, sendmsg/recvmsg_into over the same byte ranges
    memcpy        torch copy_ of the same byte ranges inside this process

Fragmentation: ``contiguous`` gives both sides pages 1..N (one run: 2L descriptors whatever the
page size); ``scattered`` gives the decode the same pages in reverse order, so no two pages merge
(N runs: N x 2L descriptors, the worst case a fragmented pool can produce).

Per request: latency (sender: send() -> the decode saw Success, the clocks being the same
CLOCK_MONOTONIC; others: from the first byte offered to the last one in place), GB/s of KV
payload (1e9 bytes), descriptors. Methods take turns request by request (so load from elsewhere
hits them alike); a configuration above ``--single-iteration-above`` descriptors runs once.
Bytes are checked once per configuration and method: the destination is zeroed, one request
runs, and a crc32 per buffer of the destination pages must equal the source's. Results go to
stdout as a markdown table and, with ``--json``, to a file.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from common.tools import bench_transfer_peer as peer
from transfer import descriptors as d
from transfer.backends.mooncake import auto_protocol  # imports mooncake itself only when an engine starts
from transfer.base import DataPlane
from transfer.descriptors import Descriptors

METHODS = ("sender", "sender-fake", "mooncake-raw", "socket", "memcpy")
FRAGMENTATIONS = ("contiguous", "scattered")
MANAGER_CONFIG = dict(bootstrap_timeout_s=60.0, waiting_timeout_s=3600.0)  # a 229k-descriptor request takes seconds


@dataclass(frozen=True)
class BenchConfig:
    layout: peer.BenchLayout
    page_sizes: tuple[int, ...] = (1, 16, 64)
    fragmentations: tuple[str, ...] = FRAGMENTATIONS
    methods: tuple[str, ...] = METHODS
    iterations: int = 3
    single_iteration_above: int = 20_000  # descriptors per request beyond which a config runs once
    transfer_timeout_s: float = 60.0  # mooncake MC_TRANSFER_TIMEOUT: one huge batch must fit in it


class CountingPlane(DataPlane):
    """Wraps the manager's data plane to see what it asks of the engine: descriptors, batches, time."""

    def __init__(self, inner: DataPlane) -> None:
        self.inner, self.name, self.max_batch_entries = inner, inner.name, inner.max_batch_entries
        self.reset()

    def reset(self) -> None:
        self.descriptors, self.batches, self.engine_s = 0, 0, 0.0

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def write(self, peer_session: str, desc: Descriptors) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.write(peer_session, desc)
        self.engine_s += time.perf_counter() - t0
        self.descriptors, self.batches = self.descriptors + len(desc), self.batches + 1
        return ok

    def close(self) -> None:
        self.inner.close()


class Rig:
    """Both sides set up for one page size: managers, bootstrap servers, the socket, the raw engine."""

    def __init__(self, cfg: BenchConfig, page_size: int, src: torch.Tensor, child: peer.Child, raw: Any | None) -> None:
        from bootstrap_server.server import BootstrapServer
        from transfer import AuxPool, KVManagerConfig, create_data_plane
        from transfer.bootstrap import HttpBootstrapClient
        from transfer.prefill import PrefillKVManager

        self.cfg, self.page_size, self.src, self.child, self.raw = cfg, page_size, src, child, raw
        self.layout = cfg.layout
        mine = tuple(b for m, b in (("sender", "mooncake"), ("sender-fake", "fake")) if m in cfg.methods)
        # The decode's mooncake engine is also where raw writes land.
        backends = mine + (("mooncake",) if raw is not None and "mooncake" not in mine else ())
        spec = peer.RigSpec(self.layout, page_size, src.numel(), backends, MANAGER_CONFIG, cfg.transfer_timeout_s)
        info = child.call("setup", spec)
        self.sessions: dict[str, str] = info["sessions"]
        buf = self.layout.buffer_nbytes(page_size)
        self.dst_ptrs = [info["kv_base"] + b * buf for b in range(self.layout.num_buffers)]
        self.src_ptrs = [src.data_ptr() + b * buf for b in range(self.layout.num_buffers)]
        self.servers: list[Any] = []
        self.managers: dict[str, Any] = {}
        self.planes: dict[str, CountingPlane] = {}
        self.addrs: dict[str, str] = {}
        self.aux = AuxPool(4, top_k=0)
        args = peer.kv_args(self.layout, page_size, src.data_ptr(), self.aux)
        for name in mine:
            server = BootstrapServer("127.0.0.1", 0)
            server.start()
            self.servers.append(server)
            self.addrs[name] = f"127.0.0.1:{server.port}"
            plane = self.planes[name] = CountingPlane(
                create_data_plane(name, host="127.0.0.1", transfer_timeout_s=cfg.transfer_timeout_s))
            self.managers[name] = PrefillKVManager(args, plane, HttpBootstrapClient(), self.addrs[name],
                                                   KVManagerConfig.defaults(**MANAGER_CONFIG))
        self.sock = socket.create_connection(("127.0.0.1", info["sock_port"]), timeout=600)
        self.room = page_size << 20  # rooms unique per rig, so a late status cannot match another request

    def close(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        for server in self.servers:
            server.stop()
        self.sock.close()
        self.child.call("teardown")

    def next_room(self) -> int:
        self.room += 1
        return self.room


# --- one request per method: each returns (latency seconds, extras) -------------------------------
def sender_request(rig: Rig, backend: str, src: list[int], dst: list[int]) -> tuple[float, dict[str, float]]:
    from transfer import AuxRecord, KVPoll

    room, mgr, plane = rig.next_room(), rig.managers[backend], rig.planes[backend]
    t_req = time.monotonic()
    sender = mgr.create_sender(room)
    rig.child.send("room", backend, room, rig.addrs[backend], dst, 1)
    peer.wait_state(sender, lambda s: s is KVPoll.WaitingForInput, timeout_s=60)
    plane.reset()
    t0 = time.monotonic()
    sender.send(src, True, AuxRecord(room=0, token_id=room % 50_000, cached_tokens=len(src)))
    peer.wait_state(sender, lambda s: s is KVPoll.Success, timeout_s=3600)
    rep = rig.child.reply(timeout_s=3600)
    if rep["status"] != "Success":
        raise RuntimeError(f"room {room}: decode saw {rep['status']}: {rep['reason']}")
    if (backend != "fake") and (rep["aux"]["room"], rep["aux"]["token_id"]) != (room, room % 50_000):
        raise RuntimeError(f"room {room}: aux row on the decode is {rep['aux']}")
    latency = rep["t_done"] - t0
    return latency, {"handshake_ms": (t0 - t_req) * 1e3, "engine_ms": plane.engine_s * 1e3,
                     "other_ms": (latency - plane.engine_s) * 1e3, "descriptors": plane.descriptors,
                     "batches": plane.batches}


def raw_request(rig: Rig, desc: Descriptors) -> tuple[float, dict[str, float]]:
    session, batches = rig.sessions["mooncake"], 0
    t0 = time.monotonic()
    for b in d.split(desc, 2000):  # the engine's per-peer batch limit (docs/TRANSFER.md §5)
        rc = rig.raw.batch_transfer_sync_write(session, b.src, b.dst, b.lens)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write of {len(b)} descriptors returned {rc}")
        batches += 1
    return time.monotonic() - t0, {"descriptors": len(desc), "batches": batches}


def socket_request(rig: Rig, src: list[int], dst: list[int]) -> tuple[float, dict[str, float]]:
    rig.child.call("sock_prepare", src, dst)
    offsets, lens = peer.side_ranges(rig.layout, rig.page_size, src, dst, "src")
    views = peer.make_views(memoryview(rig.src.numpy()), offsets, lens)
    rig.child.send("sock_recv")
    t0 = time.monotonic()
    peer.send_views(rig.sock, views)
    return rig.child.reply(timeout_s=600) - t0, {"descriptors": len(views)}


def memcpy_request(rig: Rig, target: torch.Tensor, src: list[int], dst: list[int]) -> tuple[float, dict[str, float]]:
    so, lens = peer.side_ranges(rig.layout, rig.page_size, src, dst, "src")
    do, _ = peer.side_ranges(rig.layout, rig.page_size, src, dst, "dst")
    pairs = [(target[o:o + n], rig.src[s:s + n]) for s, o, n in zip(so.tolist(), do.tolist(), lens.tolist())]
    t0 = time.monotonic()
    for out, inp in pairs:
        out.copy_(inp)
    return time.monotonic() - t0, {"descriptors": len(pairs)}


# --- driver ---------------------------------------------------------------------------------------
def page_lists(n: int, fragmentation: str) -> tuple[list[int], list[int]]:
    src = list(range(1, n + 1))  # page 0 is reserved, as in KVPool
    return src, (src if fragmentation == "contiguous" else src[::-1])


def run(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    lay, t_start = cfg.layout, time.monotonic()
    torch.set_num_threads(1)  # one core per copy, as one TCP stream gets: memcpy is not a parallel fill
    raw = None
    if "mooncake-raw" in cfg.methods:
        # Mooncake reads these when the engine starts (the backend sets the same for its engines).
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(int(cfg.transfer_timeout_s))
        from mooncake.engine import TransferEngine

        raw = TransferEngine()
        if raw.initialize("127.0.0.1", "P2PHANDSHAKE", auto_protocol(), "") != 0:
            raise RuntimeError("raw mooncake engine failed to initialize")
    capacity = lay.capacity(list(cfg.page_sizes))
    src = torch.empty(capacity, dtype=torch.uint8)  # [capacity]: every prefill buffer, carved per page size
    peer.fill_pattern(src)
    target = torch.zeros(capacity, dtype=torch.uint8) if "memcpy" in cfg.methods else None  # memcpy destination
    if raw is not None and raw.register_memory(src.data_ptr(), capacity) != 0:
        raise RuntimeError("raw mooncake engine could not register the source KV")
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    child = peer.Child()
    try:
        for ps in cfg.page_sizes:
            rig = Rig(cfg, ps, src, child, raw)
            try:
                for backend in rig.managers:  # warm-up: bootstrap lookup, KV args, engine connections
                    sender_request(rig, backend, [1], [1])
                if raw is not None:
                    raw_request(rig, d.build([1], [1], rig.src_ptrs, rig.dst_ptrs, [lay.page_nbytes(ps)] * lay.num_buffers))
                for frag in cfg.fragmentations:
                    results += run_config(cfg, rig, frag, target, log)
            finally:
                rig.close()
    finally:
        child.stop()
        if raw is not None:
            raw.unregister_memory(src.data_ptr())
    return {
        "machine": machine_info(load_before, os.getloadavg()),
        "config": {**asdict(cfg), "layout": asdict(lay), "request_bytes": {ps: lay.request_nbytes(ps) for ps in cfg.page_sizes}},
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "results": results,
    }


def run_config(cfg: BenchConfig, rig: Rig, frag: str, target: torch.Tensor | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    lay, ps = cfg.layout, rig.page_size
    src, dst = page_lists(lay.request_pages(ps), frag)
    item = [lay.page_nbytes(ps)] * lay.num_buffers
    t0 = time.perf_counter()
    desc = d.build(src, dst, rig.src_ptrs, rig.dst_ptrs, item)  # what a transfer worker does per chunk
    build_ms = (time.perf_counter() - t0) * 1e3
    iters = cfg.iterations if len(desc) <= cfg.single_iteration_above else 1
    want = peer.digest(rig.src, lay, ps, src)
    requests: dict[str, Callable[[], tuple[float, dict[str, float]]]] = {
        "sender": lambda: sender_request(rig, "mooncake", src, dst),
        "sender-fake": lambda: sender_request(rig, "fake", src, dst),
        "mooncake-raw": lambda: raw_request(rig, desc),
        "socket": lambda: socket_request(rig, src, dst),
        "memcpy": lambda: memcpy_request(rig, target, src, dst),  # type: ignore[arg-type]
    }
    samples: dict[str, list[tuple[float, dict[str, float]]]] = {m: [] for m in cfg.methods}
    verified: dict[str, bool | None] = dict.fromkeys(cfg.methods)
    # Round-robin over methods, so that a burst of load from elsewhere hits all of them alike.
    for i in range(iters):
        for method in cfg.methods:
            local, check = method == "memcpy", i == 0 and method != "sender-fake"
            if check:  # zero the destination: stale bytes from the previous method must not pass
                target.zero_() if local else rig.child.call("zero")  # type: ignore[union-attr]
            samples[method].append(requests[method]())
            if check:
                got = peer.digest(target, lay, ps, dst) if local else rig.child.call("digest", dst)  # type: ignore[arg-type]
                verified[method] = got == want
    rows = []
    for method in cfg.methods:
        latencies, extras = [s[0] for s in samples[method]], [s[1] for s in samples[method]]
        rows.append(summarize(lay, ps, frag, method, len(desc), build_ms, latencies, extras, verified[method]))
        log(format_row(rows[-1]))
    return rows


def summarize(lay: peer.BenchLayout, ps: int, frag: str, method: str, kv_desc: int, build_ms: float,
              latencies: list[float], extras: list[dict[str, float]], verified: bool | None) -> dict[str, Any]:
    p50 = statistics.median(latencies)
    nbytes = lay.request_nbytes(ps)
    row: dict[str, Any] = {
        "page_size": ps, "fragmentation": frag, "method": method, "iterations": len(latencies),
        "pages": lay.request_pages(ps), "bytes": nbytes, "kv_descriptors": kv_desc,
        "descriptors": int(extras[0].get("descriptors", kv_desc)),  # what this method issued per request
        "latency_ms": {"min": min(latencies) * 1e3, "p50": p50 * 1e3, "max": max(latencies) * 1e3},
        "samples_ms": [round(x * 1e3, 3) for x in latencies],
        "gbps": nbytes / p50 / 1e9 if method != "sender-fake" else None,
        "us_per_descriptor": p50 * 1e6 / max(1, int(extras[0].get("descriptors", kv_desc))),
        "verified": verified, "descriptor_build_ms": build_ms,
    }
    for key in ("handshake_ms", "engine_ms", "other_ms", "batches"):
        if key in extras[0]:
            row[key] = statistics.median(e[key] for e in extras)
    return row


def machine_info(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": load_after,
                            "mooncake_protocol": auto_protocol()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            info["mooncake"] = f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return info


# --- output ---------------------------------------------------------------------------------------
HEADER = ("| page | placement | method | iters | descriptors | MB | p50 ms | min ms | GB/s | µs/desc | verified | notes |\n"
          "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")


def format_row(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]
    notes = []
    if "handshake_ms" in r:
        notes.append(f"handshake {r['handshake_ms']:.1f} ms; engine {r['engine_ms']:.1f} + other {r['other_ms']:.1f} ms")
    if r["method"] in ("sender", "mooncake-raw"):
        notes.append(f"{r.get('batches', 0):g} batches, build {r['descriptor_build_ms']:.1f} ms")
    gbps = "—" if r["gbps"] is None else f"{r['gbps']:.2f}"
    ok = {True: "yes", False: "**NO**", None: "n/a"}[r["verified"]]
    return (f"| {r['page_size']} | {r['fragmentation']} | {r['method']} | {r['iterations']} | {r['descriptors']} "
            f"| {r['bytes'] / 1e6:.3g} | {lat['p50']:.1f} | {lat['min']:.1f} | {gbps} | {r['us_per_descriptor']:.2f} "
            f"| {ok} | {'; '.join(notes)} |")


def markdown(report: dict[str, Any]) -> str:
    return "\n".join([HEADER, *(format_row(r) for r in report["results"])])


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str | None]:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2, choices=sorted(peer.DTYPE_BY_BYTES))
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the one request moved")
    p.add_argument("--page-sizes", type=_csv(int), default=(1, 16, 64), help="comma-separated")
    p.add_argument("--fragmentation", type=_csv(str), default=FRAGMENTATIONS, help="contiguous,scattered")
    p.add_argument("--methods", type=_csv(str), default=METHODS, help=",".join(METHODS))
    p.add_argument("--iterations", type=int, default=3, help="measured requests per configuration and method")
    p.add_argument("--single-iteration-above", type=int, default=20_000,
                   help="configurations with more KV descriptors per request run one iteration")
    p.add_argument("--json", dest="json_path", help="also write the full report here")
    a = p.parse_args(argv)
    for name, values, allowed in (("methods", a.methods, METHODS), ("fragmentation", a.fragmentation, FRAGMENTATIONS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            p.error(f"--{name}: {bad or 'empty'}; choose from {','.join(allowed)}")
    if a.iterations < 1 or not a.page_sizes or min(a.page_sizes) < 1:
        p.error("--iterations and every page size must be >= 1")
    try:
        layout = peer.BenchLayout(a.layers, a.kv_heads, a.head_dim, a.dtype_bytes, a.tokens)
    except ValueError as exc:
        p.error(str(exc))
    return BenchConfig(layout, a.page_sizes, a.fragmentation, a.methods, a.iterations, a.single_iteration_above), a.json_path


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lay = cfg.layout
    print(f"# KV of {lay.tokens} tokens, {lay.layers} layers x (K,V) x {lay.kv_heads} heads x {lay.head_dim} x "
          f"{lay.dtype_bytes} B = {lay.request_nbytes(1) / 1e6:.1f} MB per request", file=sys.stderr)
    print(HEADER, file=sys.stderr)
    report = run(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    report["command"] = " ".join(["python -m common.tools.bench_transfer", *(sys.argv[1:] if argv is None else argv)])
    print(markdown(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["verified"] is not False for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
