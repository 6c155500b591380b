"""Which vector instructions this CPU has, from /proc/cpuinfo: what bench_limits reports and
what the engine checks before it runs a reduced-precision path (``--cpu-linear bf16``)."""
from __future__ import annotations

from pathlib import Path

# The instructions a reduced-precision matmul needs (oneDNN uses them when present). Without them a
# bf16 or int8 product is emulated in float32 and slower than float32 itself: the engine never
# picks one on its own, and warns when asked for one on a CPU without them.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_isa(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of ISA_FLAGS /proc/cpuinfo lists (Linux; elsewhere none), plus the two questions
    the engine asks: ``bf16`` (AVX512-BF16 or AMX-BF16) and ``int8`` (VNNI or AMX-INT8)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    isa = {f: f in flags for f in ISA_FLAGS}
    isa["bf16"] = isa["avx512_bf16"] or isa["amx_bf16"]
    isa["int8"] = isa["avx512_vnni"] or isa["avx_vnni"] or isa["amx_int8"]
    return isa

