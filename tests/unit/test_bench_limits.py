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
    assert "fp32 GFLOP/s" in capsys.readouterr().out


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
