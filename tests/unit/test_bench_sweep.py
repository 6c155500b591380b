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

    a.num_prompts = 10

    def run_once() -> tuple[int, dict]:
        seen.append((a.request_rate, a.warmup_requests, a.seed, a.prompt_salt, a.json_path))
        good = min(a.request_rate, 2.0)  # a stand-in engine that saturates at 2 req/s
        return 0, {"summary": {"request_throughput": a.request_rate, "completed": 10,
                               "goodput": {"request_goodput": good, "good_requests": int(5 * good)}}}

    rc, doc = sweep(a, run_once)
    assert rc == 0
    # One seed (the same shapes at every rate), new prompt contents per rate.
    assert [s[:4] for s in seen] == [(1.0, 1, 1, 0), (2.0, 0, 1, 1), (4.0, 0, 1, 2)]
    assert [r["request_goodput"] for r in doc["sweep"]] == [1.0, 2.0, 2.0]
    assert [r["attainment"] for r in doc["sweep"]] == [0.5, 1.0, 1.0]
    for *_, path in seen:
        assert json.loads(Path(path).read_text())["summary"]["completed"] == 10
    png = Path(doc["plots"]["goodput"]["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a.json_path == str(tmp_path / "run.json") and (a.warmup_requests, a.seed, a.prompt_salt) == (1, 1, None)
    # 50 % at 1 req/s already falls short of the default 90 %: the capacity is below the sweep.
    assert doc["capacity"] == {"rate": 1.0, "bound": "<"} and doc["slo_attainment"] == 0.9


def test_a_salt_keeps_the_shapes_and_arrival_pattern_and_changes_the_prompts() -> None:
    mix = [(16, 0.9), (64, 0.1)]
    slow = make_workload(300, 1, 8, 0.5, 100, 1.0, seed=4, mix=mix, prompt_salt=0)
    fast = make_workload(300, 1, 8, 0.5, 100, 4.0, seed=4, mix=mix, prompt_salt=1)
    assert [(r.input_len, r.output_len) for r in slow] == [(r.input_len, r.output_len) for r in fast]
    assert fast[-1].arrival_s > 0
    assert all(abs(s.arrival_s - 4 * f.arrival_s) < 1e-9 * max(1.0, s.arrival_s) for s, f in zip(slow, fast))
    same = sum(s.input_ids == f.input_ids for s, f in zip(slow, fast))
    assert same == 0
    assert slow == make_workload(300, 1, 8, 0.5, 100, 1.0, seed=4, mix=mix, prompt_salt=0)
    # Without a salt the workload is the one a seed always gave (tokens from the same generator).
    assert make_workload(50, 20, 8, 0.5, 100, 2.0, seed=4) == make_workload(50, 20, 8, 0.5, 100, 2.0, seed=4)
    assert make_workload(50, 20, 8, 0.5, 100, 2.0, seed=4) != make_workload(50, 20, 8, 0.5, 100, 2.0, seed=4,
                                                                            prompt_salt=0)


def test_capacity_is_the_highest_rate_within_the_attainment_interpolated() -> None:
    from common.tools.bench_run import capacity, format_capacity

    def rows(*pairs: tuple[float, float]) -> list[dict]:
        return [{"rate": r, "attainment": att} for r, att in pairs]

    # Held at 1 and 2, fell to 70 % at 3: 90 % is crossed a fifth of the way from 2 to 3 (95 -> 70).
    cap = capacity(rows((3.0, 0.70), (1.0, 1.0), (2.0, 0.95)), 0.9)
    assert cap == {"rate": 2.2, "bound": "="} and format_capacity(cap) == "2.2 req/s"
    # A later rate that holds again does not count: the first shortfall ends the walk.
    assert capacity(rows((1.0, 0.9), (2.0, 0.5), (3.0, 0.95)), 0.9) == {"rate": 1.0, "bound": "="}
    assert capacity(rows((1.0, 1.0), (2.0, 0.99)), 0.9) == {"rate": 2.0, "bound": ">="}
    assert capacity(rows((1.0, 0.5), (2.0, 0.2)), 0.9) == {"rate": 1.0, "bound": "<"}
    assert format_capacity({"rate": 2.0, "bound": ">="}) == ">= 2 req/s"
    assert capacity([], 0.9) == {"rate": None, "bound": None}
    assert "--slo-attainment" in check_args(parse_args(["--url", "http://x", "--slo-attainment", "1.5"]))


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
    assert len(lines) == 3  # no capacity row without the sweeps' capacities


def test_compare_sweep_table_gives_each_capacity_and_their_ratio() -> None:
    from common.tools.bench_peers import sweep_table

    def run(cap: dict, *atts: float) -> dict:
        return {"sweep": [{"rate": r, "request_goodput": r * a, "attainment": a} for r, a in zip((1.0, 2.0), atts)],
                "capacity": cap, "slo_attainment": 0.9}

    lines = sweep_table({"pdcluster": run({"rate": 2.0, "bound": ">="}, 1.0, 0.95),
                         "vllm-cpu": run({"rate": 1.25, "bound": "="}, 0.95, 0.75)}).splitlines()
    assert "1.900 (95 %)" in lines[2] and "1.500 (75 %)" in lines[2]
    assert "capacity at 90 % SLO" in lines[3]
    assert ">= 2 req/s" in lines[4] and "1.25 req/s" in lines[4] and lines[4].endswith(">= 1.60x")
    both = sweep_table({"pdcluster": run({"rate": 2.0, "bound": ">="}, 1.0, 1.0),
                        "vllm-cpu": run({"rate": 2.0, "bound": ">="}, 1.0, 1.0)}).splitlines()
    assert both[-1].split()[-1] == "?"  # both only bounded from below: nothing to say


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
