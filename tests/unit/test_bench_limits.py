"""bench_limits: a tiny run produces a sane table and JSON; rows are chosen by thread count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.tools import bench_limits


def test_small_run_writes_positive_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "limits.json"
    assert bench_limits.main(["--threads", "1", "--mib", "8", "--n", "64", "--repeat", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["threads"] == 1 and row["read_gbs"] > 0 and row["fp32_gflops"] > 0
    # The peak is the faster kernel's (MKL's sgemm, oneDNN's packed linear), each reported.
    assert row["fp32_gflops"] == max(row["fp32_mm_gflops"], row.get("fp32_onednn_gflops", 0.0))
    # The read limit is the faster page size's (torch's small pages, 2-MiB pages), each reported.
    assert row["read_gbs"] == max(row["read_small_pages_gbs"], row["read_huge_pages_gbs"]) > 0
    assert "fp32 GFLOP/s" in capsys.readouterr().out
    assert set(data["isa"]) >= {"avx2", "bf16", "int8"} and data["bf16"] == data["isa"]["bf16"]


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench_limits.main(["--threads", "0"])
    with pytest.raises(SystemExit):
        bench_limits.main(["--threads", "a,b"])


def test_for_threads_picks_largest_not_above() -> None:
    limits = {"rows": [{"threads": 1, "fp32_gflops": 30.0}, {"threads": 4, "fp32_gflops": 100.0}]}
    assert bench_limits.for_threads(limits, 2)["threads"] == 1
    assert bench_limits.for_threads(limits, 8)["threads"] == 4
    assert bench_limits.for_threads({"rows": [{"threads": 2}]}, 1)["threads"] == 2


def test_cpu_isa_reads_the_flags_line() -> None:
    """Reduced precision is offered only where the instructions are: this box's AMD EPYC (AVX2, no
    AVX-512) has neither bf16 nor int8; a Sapphire Rapids line has both."""
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 bmi2 sha_ni vaes\nbogomips\t: 4890\n"
    isa = bench_limits.cpu_isa(epyc)
    assert isa["avx2"] and isa["fma"] and not isa["avx512f"] and not isa["bf16"] and not isa["int8"]
    spr = "flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8 amx_tile\n"
    isa = bench_limits.cpu_isa(spr)
    assert isa["bf16"] and isa["int8"] and isa["amx_bf16"]
    assert bench_limits.cpu_isa("flags\t: avx2 avx_vnni\n")["int8"] and not bench_limits.cpu_isa("")["avx2"]
