"""The decode side of ``python -m common.tools.bench_transfer`` (a child process), and helpers both
sides share.

The parent (``common.tools.bench_transfer``, through ``Child`` below) plays the prefill: it owns
the source KV, the ``PrefillKVManager``s, a raw mooncake engine and the memcpy target. This child
plays the decode: it owns the destination KV, one ``DecodeKVManager`` per backend and the
receiving end of the raw socket. Commands arrive as tuples over a pipe; each gets exactly one
reply, ``("ok", value)`` or ``("err", text)``::

    ("setup", spec: RigSpec)                      -> {"sessions": {backend: id}, "kv_base": int, "sock_port": int}
    ("room", backend, room, addr, dst_pages, aux)  -> {"status", "reason", "t_ready", "t_done", "aux"}
    ("sock_prepare", src_pages, dst_pages)         -> None: the destination ranges are ready
    ("sock_recv",)                                 -> t_done: every byte is in place
    ("zero",)  ("digest", pages) -> [crc32 per buffer]  ("teardown",)  ("close",)

Times are ``time.monotonic()``, one clock for every process of a Linux host, so the parent can
subtract its own timestamps from ours.

KV memory is one flat allocation per side, carved per page size into buffers laid out like
``common.kvcache.pool.KVPool``'s (K of layers 0..L-1, then V; each ``[num_pages * page_size,
kv_heads, head_dim]``)::

    flat: | buf 0 (K layer 0) | buf 1 | ... | buf 2L-1 (V layer L-1) | unused tail |
          `-- buffer_nbytes --'        page p of buf b at b * buffer_nbytes + p * page_nbytes
"""
from __future__ import annotations

import bisect
import math
import multiprocessing.connection
import os
import socket
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.tools.pipe_peer import PeerProcess, answer
from transfer.descriptors import merge_runs

DTYPE_BY_BYTES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}
IOV_MAX = 1024  # Linux: most buffers one sendmsg/recvmsg call takes
_WINDOW_BYTES = 8 << 20  # recvmsg_into windows: bounded so partial reads do not rebuild huge lists
POLL_S = 0.0005  # how often both sides poll a room: small next to any transfer, cheap on 2 cores


@dataclass(frozen=True)
class BenchLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    tokens: int

    def __post_init__(self) -> None:
        if self.dtype_bytes not in DTYPE_BY_BYTES:
            raise ValueError(f"dtype bytes must be one of {sorted(DTYPE_BY_BYTES)}, got {self.dtype_bytes}")
        if min(self.layers, self.kv_heads, self.head_dim, self.tokens) < 1:
            raise ValueError("layers, kv heads, head dim and tokens must be >= 1")

    @property
    def dtype(self) -> str:
        return DTYPE_BY_BYTES[self.dtype_bytes]

    @property
    def num_buffers(self) -> int:
        return 2 * self.layers

    @property
    def token_nbytes(self) -> int:
        """Bytes of K (or V) of one token in one layer."""
        return self.kv_heads * self.head_dim * self.dtype_bytes

    def request_pages(self, page_size: int) -> int:
        return math.ceil(self.tokens / page_size)

    def page_nbytes(self, page_size: int) -> int:
        return page_size * self.token_nbytes

    def buffer_nbytes(self, page_size: int) -> int:
        # One request's pages plus the reserved page 0 (never handed out, as in KVPool).
        return (self.request_pages(page_size) + 1) * self.page_nbytes(page_size)

    def request_nbytes(self, page_size: int) -> int:
        return self.request_pages(page_size) * self.page_nbytes(page_size) * self.num_buffers

    def capacity(self, page_sizes: list[int]) -> int:
        """Flat bytes that hold the buffers of every page size (rounded up to whole int64 words)."""
        need = max(self.buffer_nbytes(ps) for ps in page_sizes) * self.num_buffers
        return -(-need // 8) * 8


@dataclass(frozen=True)
class RigSpec:
    """What the child builds for one page size."""

    layout: BenchLayout
    page_size: int
    capacity: int
    backends: tuple[str, ...]  # DecodeKVManager per backend ("mooncake", "fake")
    manager_config: dict[str, float]
    transfer_timeout_s: float


def fill_pattern(flat: torch.Tensor) -> None:
    """Every 8-byte word distinct (index x odd constant, mod 2^64): a misplaced page cannot match."""
    words = flat.view(torch.int64)  # [capacity / 8]
    step = 1 << 24
    for i in range(0, words.numel(), step):
        n = min(step, words.numel() - i)
        torch.arange(i, i + n, dtype=torch.int64, out=words[i:i + n]).mul_(-7046029254386353131)  # 0x9E37..15 as i64


def byte_ranges(layout: BenchLayout, page_size: int, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat offsets, lengths) of page runs in every buffer, buffer-major (descriptor order)."""
    page, buf = layout.page_nbytes(page_size), layout.buffer_nbytes(page_size)
    base = np.arange(layout.num_buffers, dtype=np.int64)[:, None] * buf  # [buffers, 1]
    offsets = base + starts[None, :].astype(np.int64) * page  # [buffers, runs]
    lens = np.broadcast_to(lengths[None, :].astype(np.int64) * page, offsets.shape)  # [buffers, runs]
    return offsets.ravel(), lens.ravel()


def side_ranges(layout: BenchLayout, page_size: int, src: list[int], dst: list[int], side: str) -> tuple[np.ndarray, np.ndarray]:
    """The byte ranges of the merged descriptors on one side ("src" or "dst")."""
    s0, d0, n = merge_runs(src, dst)
    return byte_ranges(layout, page_size, s0 if side == "src" else d0, n)


def digest(flat: torch.Tensor, layout: BenchLayout, page_size: int, pages: list[int]) -> list[int]:
    """crc32 of each buffer's ``pages``, in the given order (what the other side must have sent)."""
    buf, page = layout.buffer_nbytes(page_size), layout.page_nbytes(page_size)
    idx = torch.tensor(pages, dtype=torch.int64)  # [pages]
    out = []
    for b in range(layout.num_buffers):
        rows = flat[b * buf:(b + 1) * buf].view(-1, page)  # [num_pages, page_nbytes]
        out.append(zlib.crc32(memoryview(rows.index_select(0, idx).numpy())))
    return out


def make_views(mv: memoryview, offsets: np.ndarray, lens: np.ndarray) -> list[memoryview]:
    """One memoryview per byte range (built before the clock starts, like registered memory)."""
    return [mv[o:o + n] for o, n in zip(offsets.tolist(), lens.tolist())]


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Gather-send with sendmsg (up to IOV_MAX buffers per call), resuming partial sends."""
    i, done = 0, 0  # next view; bytes of it already sent
    while i < len(views):
        sent = sock.sendmsg([views[i][done:], *views[i + 1:i + IOV_MAX]])
        i, done = _advance(views, i, done, sent)


def recv_views(sock: socket.socket, views: list[memoryview], ends: list[int] | None = None) -> None:
    """Scatter-receive with recvmsg_into, resuming partial reads.

    Each call offers at most IOV_MAX buffers covering about ``_WINDOW_BYTES``: a read returns what
    the socket holds (often far less than offered), and rebuilding a 1024-entry list after every
    short read would cost more than the copy.
    """
    if ends is None:
        ends = np.cumsum([len(v) for v in views]).tolist()  # ends[k]: stream offset where view k ends
    i, done = 0, 0
    while i < len(views):
        pos = (ends[i - 1] if i else 0) + done
        j = min(bisect.bisect_right(ends, pos + _WINDOW_BYTES) + 1, i + IOV_MAX, len(views))
        got = sock.recvmsg_into([views[i][done:], *views[i + 1:j]])[0]
        if got == 0:
            raise ConnectionError(f"socket closed with {ends[-1] - pos} bytes still to receive")
        i, done = _advance(views, i, done, got)


def _advance(views: list[memoryview], i: int, done: int, nbytes: int) -> tuple[int, int]:
    """Move the (view, offset-in-view) cursor forward by ``nbytes``."""
    done += nbytes
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    return i, done


def kv_args(layout: BenchLayout, page_size: int, base_ptr: int, aux: Any) -> Any:
    """KVArgs over the carved buffers (the same shape ``KVArgs.kv_from_pool`` gives a KVPool)."""
    from common.kvcache.pool import KVLayout
    from transfer.args import BufferSet, KVArgs

    n, buf = layout.num_buffers, layout.buffer_nbytes(page_size)
    kv = BufferSet(tuple(base_ptr + b * buf for b in range(n)), (buf,) * n, (layout.page_nbytes(page_size),) * n)
    kv_layout = KVLayout(layout.layers, layout.kv_heads, layout.head_dim, page_size, layout.dtype)
    return KVArgs(layout=kv_layout, kv=kv, aux=aux.buffers(), aux_top_k=aux.top_k)


def wait_state(handle: Any, done: Any, timeout_s: float) -> Any:
    """Poll a sender/receiver until ``done(state)``; raise if it ends elsewhere or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = handle.poll()
        if done(st):
            return st
        if st.terminal:
            raise RuntimeError(f"room {handle.room} ended {st.name}: {handle.failure_reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"room {handle.room} stuck in {st.name} after {timeout_s}s")
        time.sleep(POLL_S)


class _Decode:
    """Everything the child holds; rebuilt per page size by ``setup``, memory kept across them."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None  # uint8 [capacity]
        self.spec: RigSpec | None = None
        self.managers: dict[str, Any] = {}
        self.aux: Any = None
        self.listener: socket.socket | None = None
        self.sock: socket.socket | None = None
        self.views: list[memoryview] = []  # destination ranges of the next socket transfer
        self.ends: list[int] = []  # stream offset where each view ends

    def setup(self, spec: RigSpec) -> dict[str, Any]:
        from transfer import AuxPool, KVManagerConfig, create_data_plane
        from transfer.bootstrap import HttpBootstrapClient
        from transfer.decode import DecodeKVManager

        self.teardown()
        if self.flat is None or self.flat.numel() < spec.capacity:
            self.flat = None
            self.flat = torch.zeros(spec.capacity, dtype=torch.uint8)  # [capacity]
        self.spec = spec
        self.aux = AuxPool(4, top_k=0)
        args = kv_args(spec.layout, spec.page_size, self.flat.data_ptr(), self.aux)
        cfg = KVManagerConfig.defaults(**spec.manager_config)
        sessions = {}
        for name in spec.backends:
            engine = create_data_plane(name, host="127.0.0.1", transfer_timeout_s=spec.transfer_timeout_s)
            self.managers[name] = DecodeKVManager(args, engine, HttpBootstrapClient(), cfg)
            sessions[name] = engine.session_id
        self.listener = socket.create_server(("127.0.0.1", 0))
        return {"sessions": sessions, "kv_base": self.flat.data_ptr(), "sock_port": self.listener.getsockname()[1]}

    def room(self, backend: str, room: int, addr: str, dst_pages: list[int], aux_slot: int) -> dict[str, Any]:
        from transfer.poll import KVPoll

        recv = self.managers[backend].create_receiver(room, addr)
        wait_state(recv, lambda s: s is KVPoll.WaitingForInput, timeout_s=60)
        t_ready = time.monotonic()
        recv.init(dst_pages, aux_slot)
        st = wait_state(recv, lambda s: s.terminal, timeout_s=3600)
        t_done = time.monotonic()
        return {"status": st.name, "reason": recv.failure_reason, "t_ready": t_ready, "t_done": t_done,
                "aux": self.aux.read(aux_slot).__dict__}

    def sock_prepare(self, src: list[int], dst: list[int]) -> None:
        assert self.spec is not None and self.flat is not None and self.listener is not None
        if self.sock is None:
            self.listener.settimeout(30)
            self.sock, _ = self.listener.accept()
            self.sock.settimeout(600)
        offsets, lens = side_ranges(self.spec.layout, self.spec.page_size, src, dst, "dst")
        self.views = make_views(memoryview(self.flat.numpy()), offsets, lens)
        self.ends = np.cumsum(lens).tolist()

    def sock_recv(self) -> float:
        assert self.sock is not None
        recv_views(self.sock, self.views, self.ends)
        return time.monotonic()

    def teardown(self) -> None:
        for mgr in self.managers.values():
            mgr.close()
        self.managers.clear()
        self.views = []
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()
        self.sock = self.listener = None


def serve(conn: multiprocessing.connection.Connection) -> None:
    """Child entry point: answer commands until "close" or until the parent's end of the pipe closes."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    torch.set_num_threads(1)  # two processes share the machine's cores with mooncake's threads
    d = _Decode()
    conn.send(("ok", os.getpid()))

    def zero() -> None:
        assert d.flat is not None
        d.flat.zero_()

    def page_digest(pages: list[int]) -> list[int]:
        assert d.flat is not None and d.spec is not None
        return digest(d.flat, d.spec.layout, d.spec.page_size, pages)

    try:
        answer(conn, {"setup": d.setup, "room": d.room, "sock_prepare": d.sock_prepare, "sock_recv": d.sock_recv,
                      "zero": zero, "digest": page_digest, "teardown": d.teardown})
    finally:
        d.teardown()
        conn.close()


class Child(PeerProcess):
    """The parent's handle on this module's ``serve`` in a child process (bounded calls; ``stop``
    asks it to close, then kills it by PID)."""

    def __init__(self) -> None:
        super().__init__(serve, name="decode child")
