"""The decode-step benchmark tool runs the real engine at each batch size, with the decode mirror
on and off, and leaves the KV pool as it found it (it checks integrity itself)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.tools import bench_decode_step


@pytest.mark.parametrize("mirror", ["1024", "0"])
def test_runs_each_batch_and_writes_json(tiny_qwen3: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         mirror: str) -> None:
    out = tmp_path / "step.json"
    rc = bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "1,3", "--context", "20", "--warmup", "1",
                                 "--steps", "4", "--torch-decode-mirror-mib", mirror, "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["ms_per_step"] > 0 for r in rows)
    assert "| 3 |" in capsys.readouterr().out


def test_bad_arguments_exit_2(tiny_qwen3: str) -> None:
    assert bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "0"]) == 2
    assert bench_decode_step.main(["--model-path", tiny_qwen3 + "-missing"]) == 2
    assert bench_decode_step.main(["--model-path", tiny_qwen3, "--page-size", "3"]) == 2


def test_limits_add_the_roofline_of_each_step(tiny_qwen3: str, tmp_path: Path) -> None:
    from common.tools.roofline import Shape, decode_bytes, decode_flops

    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"rows": [{"threads": 1, "read_gbs": 10.0, "fp32_gflops": 20.0}]}))
    out = tmp_path / "step.json"
    rc = bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "2", "--context", "20", "--warmup", "1",
                                 "--steps", "4", "--limits", str(limits), "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    shape = Shape.from_config(json.loads((Path(tiny_qwen3) / "config.json").read_text()))
    ctx = 20 + 1 + 2
    want_ms = 1000 * max(decode_bytes(shape, 2, ctx) / 10e9, decode_flops(shape, 2, ctx) / 20e9)
    assert row["roofline_ms"] == pytest.approx(want_ms)
    assert row["x_roofline"] == pytest.approx(row["ms_per_step"] / want_ms)
    assert bench_decode_step.main(["--model-path", tiny_qwen3, "--limits", str(tmp_path / "none.json")]) == 2


def test_prefill_reports_model_flops_over_the_peak(tiny_qwen3: str, tmp_path: Path) -> None:
    """--prefill times one prompt per length on the same runner; its GFLOP/s is roofline's count
    over the median time, and the share of the peak divides by the --limits row."""
    from common.tools.roofline import Shape, prefill_flops

    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"rows": [{"threads": 1, "read_gbs": 10.0, "fp32_gflops": 20.0}]}))
    out = tmp_path / "prefill.json"
    rc = bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "", "--prefill", "40,8",
                                 "--prefill-repeat", "3", "--limits", str(limits), "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] == []  # no decode steps asked for
    shape = Shape.from_config(json.loads((Path(tiny_qwen3) / "config.json").read_text()))
    for row, n in zip(doc["prefill"], [40, 8]):
        assert row["tokens"] == n and row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["gflops"] == pytest.approx(prefill_flops(shape, n) / row["median_s"] / 1e9)
        assert row["of_peak"] == pytest.approx(row["gflops"] / 20.0)
    assert bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "", "--prefill", "0"]) == 2
    assert bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", ""]) == 2


def test_a_step_that_grows_the_mirror_is_reported_apart(tiny_qwen3: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # 20 prompt tokens: the mirror's first capacity is 64 positions, so a window of 50 steps after
    # one warm-up crosses it once; with the mirror off nothing grows.
    out = tmp_path / "step.json"
    args = ["--model-path", tiny_qwen3, "--batch", "2", "--context", "20", "--warmup", "1", "--steps", "50",
            "--json", str(out)]
    assert bench_decode_step.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["growth_steps_ms"]) == 1
    grew = row["growth_steps_ms"][0]
    # ms / step is the mean of the other 49; the mean of all 50 includes the growth
    assert row["mean_all_ms"] == pytest.approx((49 * row["ms_per_step"] + grew) / 50)
    assert "grew the decode mirror" in capsys.readouterr().out
    assert bench_decode_step.main([*args, "--torch-decode-mirror-mib", "0"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["growth_steps_ms"] == [] and row["mean_all_ms"] == pytest.approx(row["ms_per_step"])
    # Each batch size starts from an empty mirror: the second row crosses 64 again instead of
    # inheriting the first's capacity (128 after its growth).
    args[args.index("--batch") + 1] = "2,2"
    assert bench_decode_step.main(args) == 0
    assert [len(r["growth_steps_ms"]) for r in json.loads(out.read_text())["rows"]] == [1, 1]


def test_limits_measured_in_process(tiny_qwen3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.tools.roofline import Shape, decode_bytes, decode_flops

    # smaller than a real measurement (a buffer past the caches), enough to check the wiring
    monkeypatch.setattr(bench_decode_step, "MEASURE_MIB", 32)
    monkeypatch.setattr(bench_decode_step, "MEASURE_N", 256)
    monkeypatch.setattr(bench_decode_step, "MEASURE_REPEAT", 1)
    out = tmp_path / "step.json"
    rc = bench_decode_step.main(["--model-path", tiny_qwen3, "--batch", "2", "--context", "20", "--warmup", "1",
                                 "--steps", "4", "--limits", "measure", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    limits, (row,) = result["limits"], result["rows"]
    assert limits["threads"] == 1 and limits["read_gbs"] > 0 and limits["fp32_gflops"] > 0
    shape = Shape.from_config(json.loads((Path(tiny_qwen3) / "config.json").read_text()))
    ctx = 20 + 1 + 2
    want_ms = 1000 * max(decode_bytes(shape, 2, ctx) / (limits["read_gbs"] * 1e9),
                         decode_flops(shape, 2, ctx) / (limits["fp32_gflops"] * 1e9))
    assert row["roofline_ms"] == pytest.approx(want_ms)
