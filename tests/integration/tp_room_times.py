"""Time one room end to end (create -> both sides Success) per (prefill TP, decode TP) over real
Mooncake TCP, with the transfer-layer harness of ``test_transfer_tp`` at a real size: 63 pages x
16 tokens, 4 layers, 8 KV heads, head_dim 128, float32 (33 MB), in two chunks, decode pages in
two runs, 16 staging pages per prefill worker. A measurement (docs/BENCHMARKS.md, "Tensor
parallelism"), not a test::

    python -m tests.integration.tp_room_times 1:1,2:2,2:1,1:2,4:1,1:4
"""
import statistics
import sys
import time

import tests.integration.test_transfer_tp as t
from bootstrap_server.server import BootstrapServer


def main(argv: list[str]) -> None:
    t.LAYERS, t.PAGE, t.DIM, t.PAGES = 4, 16, 128, 160
    t.BUFFERS, t.PREFILL_STAGING = 2 * t.LAYERS, 16
    H = 8
    srv = BootstrapServer("127.0.0.1", 0)
    srv.start()
    src = list(range(1, 64))
    dst = list(range(70, 100)) + list(range(110, 143))  # two runs, as in TRANSFER §12
    pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in argv[0].split(","))]
    for tp_p, tp_d in pairs:
        groups: list = []
        g = t.start(groups, srv.url, "mooncake", tp_p, tp_d, H, decode_staging=t.PAGES)
        times = []
        for i in range(6):
            spec = t.RoomSpec(1000 * tp_p + 100 * tp_d + i, src, dst, (32, 31))
            t0 = time.perf_counter()
            t.run_rooms(g, (spec,))
            times.append((time.perf_counter() - t0) * 1000)
        stats = [r.mgr.transfer_stats() for r in g.prefills]
        print(f"{tp_p}->{tp_d}: room ms (first, then median of 5) {times[0]:.1f}, {statistics.median(times[1:]):.1f} "
              f"[{min(times[1:]):.1f}-{max(times[1:]):.1f}]; descriptors/room {sum(s['descriptors'] for s in stats) / 6:.0f}, "
              f"bytes/room {sum(s['bytes'] for s in stats) / 6 / 1e6:.2f} MB", flush=True)
        for r in [*g.decodes, *g.prefills]:
            r.mgr.close()
    srv.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
