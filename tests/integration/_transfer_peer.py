"""One side of a transfer (prefill or decode) in a child process, driven over a multiprocessing pipe.

The parent (tests/integration/test_transfer_mooncake.py) starts it with ``spawn_peer`` and sends
commands as tuples; every command gets exactly one reply ``("ok", value)`` or ``("err", text)``.

    prefill: ("sender", room) ("send", room, pages, last, aux|None) ("poll", room) ("abort", room)
    decode:  ("receiver", room, addr) ("init", room, pages, aux_slot) ("poll", room) ("abort", room)
             ("aux", slot) -> AuxRecord
    both:    ("pages", pages) -> bytes of those pages in every KV buffer, ("stats",) ("close",)

The prefill side embeds the bootstrap server (as a prefill node does) and fills its KV pool with
a seeded pattern; the decode side starts from zeros. ``poll`` also records what a scheduler would
do: it frees a room at the first terminal state it sees; ``stats`` reports those states and
whether every later poll still returns the same one (so nothing would be freed twice).
"""
from __future__ import annotations

import multiprocessing.connection
import os
import sys
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

# Imported at module level so a forkserver that preloads this module starts children warm.
import torch  # noqa: E402

from common.kvcache.pool import KVLayout, KVPool  # noqa: E402
from common.tools.pipe_peer import answer  # noqa: E402
from transfer import KVArgs, KVManagerConfig, create_data_plane  # noqa: E402
from transfer.aux import AuxPool, AuxRecord  # noqa: E402
from transfer.bootstrap import HttpBootstrapClient  # noqa: E402
from transfer.decode import DecodeKVManager  # noqa: E402
from transfer.prefill import PrefillKVManager  # noqa: E402

LAYOUT = dict(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
NUM_PAGES = 400


@dataclass(frozen=True)
class PeerSpec:
    role: str  # "prefill" | "decode"
    backend: str  # "mooncake" | "fake"
    bootstrap_port: int  # prefill: where to embed the server
    seed: int = 0
    config: dict[str, Any] | None = None  # KVManagerConfig overrides
    transfer_timeout_s: float = 2.0


def serve(conn: multiprocessing.connection.Connection, spec: PeerSpec) -> None:
    torch.set_num_threads(1)
    layout = KVLayout(**LAYOUT)  # type: ignore[arg-type]
    pool = KVPool(layout, num_pages=NUM_PAGES, device="cpu")
    aux = AuxPool(8, top_k=4)
    if spec.role == "prefill":
        gen = torch.Generator().manual_seed(spec.seed)
        for buf in pool.buffers():
            buf.copy_(torch.randn(buf.shape, generator=gen))  # [slots, kv_heads, head_dim]
    args = KVArgs(layout=layout, kv=KVArgs.kv_from_pool(pool), aux=aux.buffers(), aux_top_k=4)
    cfg = KVManagerConfig.defaults(**(spec.config or {}))
    engine = create_data_plane(spec.backend, host="127.0.0.1", transfer_timeout_s=spec.transfer_timeout_s)
    client = HttpBootstrapClient(timeout_s=2.0, lookup_timeout_s=2.0)
    server = None
    if spec.role == "prefill":
        from bootstrap_server.server import BootstrapServer

        server = BootstrapServer("127.0.0.1", spec.bootstrap_port)
        server.start()
        mgr: Any = PrefillKVManager(args, engine, client, f"127.0.0.1:{spec.bootstrap_port}", cfg)
        info = {"endpoint": mgr.endpoint, "session": engine.session_id}
    else:
        mgr = DecodeKVManager(args, engine, client, cfg)
        info = {"endpoint": mgr.status_endpoint, "session": engine.session_id}
    handles: dict[int, Any] = {}
    terminal: dict[int, int] = {}  # room -> the terminal state first seen (a scheduler frees then)
    conn.send(("ok", info))

    def poll(room: int) -> tuple[int, str | None]:
        h = handles[room]
        st = h.poll()
        if st.terminal:
            terminal.setdefault(room, int(st))
        return int(st), h.failure_reason

    def page_bytes(pages: list[int]) -> list[bytes]:
        idx = torch.tensor(pages, dtype=torch.int64)
        out = []
        for buf in pool.buffers():
            rows = buf.view(NUM_PAGES, layout.page_size, -1)[idx]  # [pages, page_size, heads*dim]
            out.append(rows.contiguous().numpy().tobytes())
        return out

    def init(room: int, pages: list[int], aux_slot: int | None) -> None:
        handles[room].init(pages, aux_slot)

    def send(room: int, pages: list[int], last: bool, rec: dict | None) -> None:
        handles[room].send(pages, last, AuxRecord(**rec) if rec else None)

    def sender(room: int) -> None:
        handles[room] = mgr.create_sender(room)

    def receiver(room: int, addr: str) -> None:
        handles[room] = mgr.create_receiver(room, addr)

    def stats() -> dict[str, Any]:
        sticky = all(int(handles[r].poll()) == st for r, st in terminal.items())
        written = getattr(mgr, "descriptors_written", None)  # the prefill's workers
        return {"descriptors": written() if written else 0, "rooms": mgr.num_rooms(),
                "terminal": dict(terminal), "sticky": sticky}

    try:
        answer(conn, {"sender": sender, "receiver": receiver, "send": send, "init": init, "poll": poll,
                      "abort": lambda room: handles[room].abort(), "aux": lambda slot: aux.read(slot).__dict__,
                      "pages": page_bytes, "stats": stats})
    finally:
        mgr.close()
        if server is not None:
            server.stop()
        conn.close()
