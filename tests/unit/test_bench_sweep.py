"""The SLO workloads of pdcluster bench: the mixed prompt-length draw, the flags, and the rate
sweep's per-rate runs, goodput table and PNG (with a stand-in for one run)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from common.tools.bench import check_args, parse_args
from common.tools.bench_run import sweep
from common.tools.bench_workload import make_workload, parse_mix


def test_parse_mix_and_its_errors() -> None:
    assert parse_mix("128:0.9, 2048:0.1") == [(128, 0.9), (2048, 0.1)]
    for bad in ("128", "0:1", "128:0", "a:1", "128:x"):
        with pytest.raises(ValueError, match="--mixed-lengths"):
            parse_mix(bad)


def test_mixed_workload_draws_the_given_lengths_in_proportion() -> None:
    reqs = make_workload(2000, 1, 8, 1.0, 100, 4.0, seed=3, mix=[(16, 0.9), (64, 0.1)])
    counts = Counter(r.input_len for r in reqs)
    assert set(counts) == {16, 64}
    assert 0.07 < counts[64] / 2000 < 0.13  # binomial(2000, 0.1): sd 0.0067, so 4.5 sd either side
    assert all(r.output_len == 8 for r in reqs)
    assert reqs == make_workload(2000, 1, 8, 1.0, 100, 4.0, seed=3, mix=[(16, 0.9), (64, 0.1)])


def test_flags_set_the_mix_and_the_rates() -> None:
    a = parse_args(["--url", "http://x", "--workload", "mixed", "--request-rate-sweep", "0.5,1,2"])
    assert check_args(a) is None
    assert a.mix == [(128, 0.9), (2048, 0.1)] and a.input_len == 2048 and a.rates == [0.5, 1.0, 2.0]
    assert "rates" in check_args(parse_args(["--url", "http://x", "--request-rate-sweep", "1,a"]))
    assert "> 0" in check_args(parse_args(["--url", "http://x", "--request-rate-sweep", "1,0"]))
    assert "--mixed-lengths" in check_args(parse_args(["--url", "http://x", "--workload", "mixed",
                                                       "--mixed-lengths", "5"]))


def test_sweep_runs_each_rate_and_plots_goodput(tmp_path: Path) -> None:
    a = parse_args(["--url", "http://x", "--request-rate-sweep", "1,2,4", "--slo-ttft-ms", "100",
                    "--json", str(tmp_path / "run.json")])
    assert check_args(a) is None
    seen = []

    def run_once() -> tuple[int, dict]:
        seen.append((a.request_rate, a.warmup_requests, a.seed, a.json_path))
        good = min(a.request_rate, 2.0)  # a stand-in engine that saturates at 2 req/s
        return 0, {"summary": {"request_throughput": a.request_rate, "completed": 10,
                               "goodput": {"request_goodput": good, "good_requests": int(5 * good)}}}

    rc, doc = sweep(a, run_once)
    assert rc == 0
    assert [s[:3] for s in seen] == [(1.0, 1, 1), (2.0, 0, 2), (4.0, 0, 3)]
    assert [r["request_goodput"] for r in doc["sweep"]] == [1.0, 2.0, 2.0]
    for *_, path in seen:
        assert json.loads(Path(path).read_text())["summary"]["completed"] == 10
    png = Path(doc["plots"]["goodput"]["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a.json_path == str(tmp_path / "run.json") and (a.warmup_requests, a.seed) == (1, 1)  # restored


def test_without_a_sweep_the_run_is_returned_unchanged() -> None:
    a = parse_args(["--url", "http://x"])
    assert check_args(a) is None
    assert sweep(a, lambda: (1, {"x": 1})) == (1, {"x": 1})


def test_compare_sweep_table_gives_goodput_ratio_per_rate() -> None:
    from common.tools.bench_peers import sweep_table

    runs = {"pdcluster": {"sweep": [{"rate": 1.0, "request_goodput": 0.9}, {"rate": 2.0, "request_goodput": 1.5}]},
            "vllm-cpu": {"sweep": [{"rate": 1.0, "request_goodput": 0.9}, {"rate": 2.0, "request_goodput": 0.5}]}}
    lines = sweep_table(runs).splitlines()
    assert lines[1].split()[-1] == "1.00x" and lines[2].split()[-1] == "3.00x"


def test_peer_first_runs_the_peer_before_ours_and_keeps_the_table_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.tools import bench_peers

    order: list[str] = []
    monkeypatch.setattr(bench_peers, "run_launched", lambda a, model: (order.append("ours"), (0, {"summary": {}}))[1])
    monkeypatch.setattr(bench_peers, "run_peer", lambda a, model: (order.append("peer"), (0, {"summary": {}}))[1])
    monkeypatch.setattr(bench_peers, "write_json", lambda path, doc: None)
    for flags, want in (([], ["ours", "peer"]), (["--peer-first"], ["peer", "ours"])):
        order.clear()
        a = parse_args(["--launch", "--model-path", "m", "--compare", "vllm-cpu", *flags])
        assert check_args(a) is None
        assert bench_peers.compare(a, "m") == 0 and order == want
    assert "add --compare" in check_args(parse_args(["--url", "http://x", "--peer-first"]))
