"""``pdcluster bench``: the CLI against a launched cluster.

    test_cli_launch_*      the real CLI (subprocess) launches a tiny pair, behind our router or
                           with none, and runs a few requests; counts are checked against the
                           workload the test recomputes itself
    test_cli_paired_direct_measures_the_router_per_pair
                           every request sent both through our router and straight to the
                           pair: the router's added latency per pair
    test_cli_bad_arguments each bad combination of flags exits 2 with a message

The request client against a scripted server and the report arithmetic are in test_bench_parts.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.timeline import PREFILL_STAGES
from common.tools import bench_plots
from common.tools import bench_report as report
from common.tools.bench_workload import make_workload

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
CLI_TIMEOUT_S = 150.0

# ---- the CLI against a launched cluster ------------------------------------------------------------

NUM, IN_LEN, OUT_LEN, RATIO, SEED = 6, 40, 8, 0.5, 7


def run_cli(tmp_path: Path, model_dir: str, backend: str, extra: list[str]) -> tuple[int, dict, str]:
    out = tmp_path / f"bench-{backend}.json"
    cmd = [sys.executable, "-m", "common.cli", "bench", "--launch", "--make-tiny-model", "--model-path", model_dir,
           "--transfer-backend", backend, "--num-prompts", str(NUM), "--input-len", str(IN_LEN), "--output-len",
           str(OUT_LEN), "--range-ratio", str(RATIO), "--seed", str(SEED), "--request-timeout", "30",
           "--timeout", "60", "--idle-timeout", "15", "--json", str(out), *extra]
    # The bench keeps its cluster's logs in a fresh temporary directory: under tmp_path, so the
    # suite leaves nothing in /tmp.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        stdout, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the bench stops the cluster it launched on SIGTERM
        try:
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        _kill_nodes(stdout)
        raise AssertionError(f"bench did not finish within {CLI_TIMEOUT_S:g} s:\n{stdout[-3000:]}") from None
    doc = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, doc, stdout


def _kill_nodes(stdout: str) -> None:
    """Last resort after a hung bench: the process groups it printed."""
    m = re.search(r"; pids ([\d ]+);", stdout)
    for pid in (m.group(1).split() if m else []):
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def check_cli_report(rc: int, doc: dict, stdout: str, model_dir: str, rate: float, router: bool) -> None:
    assert rc == 0, stdout[-4000:]
    s = doc["summary"]
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    want = make_workload(NUM, IN_LEN, OUT_LEN, RATIO, vocab, rate, SEED)
    assert s["num_requests"] == s["completed"] == NUM and s["failed"] == 0 and s["failure_reasons"] == {}
    # Token counts: recomputed here from the seeded workload, not taken from the bench.
    assert s["total_input_tokens"] == sum(r.input_len for r in want)
    assert s["total_output_tokens"] == s["requested_output_tokens"] == sum(r.output_len for r in want)
    per_req = doc["requests"]
    assert [r["output_tokens"] for r in per_req] == [r.output_len for r in want]
    assert all(r["ok"] and r["finish_reason"] == "length" for r in per_req)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"], rel=1e-3)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    # ITL samples: one per token after the first of each request.
    assert sum(len(r["itl_s"]) for r in per_req) == sum(r.output_len - 1 for r in want)
    for r in per_req:
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["ttft_s"] + sum(r["itl_s"]) == pytest.approx(r["e2e_s"], abs=0.05)
    assert doc["leak_check_clean"] is True
    assert set(doc["nodes"]) == {"prefill0", "decode0"}
    for name in ("prefill0", "decode0"):
        assert doc["nodes"][name]["leak_problems"] == []
        assert report.idle_problems(doc["after"][name]["memory"]) == []
        assert re.search(rf"^leak check {name} +clean$", stdout, re.M), stdout[-2000:]
    assert doc["nodes"]["decode0"]["counter_deltas"]["generated_tokens_total"] == s["total_output_tokens"]
    assert doc["nodes"]["prefill0"]["counter_deltas"]["prompt_tokens_total"] == s["total_input_tokens"]
    split = doc["nodes"]["decode0"]["decode_step_split"]  # every output token after the first is one step's
    assert split["steps"] * split["mean_batch"] == pytest.approx(s["total_output_tokens"] - NUM, rel=0.01)
    assert 0 < split["forward_ms_per_step"] < split["step_ms_per_step"]
    assert "decode step split:" in stdout
    cpu = doc["cpu_seconds"]  # launched cluster: each process group, read from /proc
    want_cpu = {"prefill0_api", "prefill0_scheduler", "decode0_api", "decode0_scheduler", "bench_client"}
    assert set(cpu) == want_cpu | ({"router"} if router else set())
    assert cpu["decode0_scheduler"] > 0 and cpu["prefill0_scheduler"] > 0 and cpu["bench_client"] > 0
    assert (doc["target"]["url"] is not None) == router
    check_plots(doc, router)


def check_plots(doc: dict, router: bool) -> None:
    """The PNGs next to the JSON are real images, and the series they were drawn from (kept in the
    JSON) hold the run's data: recomputed here from the per-request results."""
    from PIL import Image

    plots = doc["plots"]
    assert set(plots) == {"latency", "timeline", "stages"}
    for name, plot in plots.items():
        path = Path(plot["png"])
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(path) as im:
            assert im.format == "PNG" and im.width >= 400 and im.height >= 200, (name, im.size)
    reqs = doc["requests"]
    lat = plots["latency"]["series"]
    assert lat["e2e_ms"]["x"] == sorted(round(r["e2e_s"] * 1000.0, 3) for r in reqs)
    assert lat["ttft_ms"]["y"][-1] == 1.0 and len(lat["itl_ms"]["x"]) == sum(len(r["itl_s"]) for r in reqs)
    tl = plots["timeline"]["series"]
    assert sum(tl["tokens_per_s"]) * bench_plots.BIN_S == pytest.approx(doc["summary"]["total_output_tokens"])
    in_flight_s = sum(tl["inflight"]) * bench_plots.BIN_S  # request-seconds in flight = sum of E2E
    # each bin's mean is stored to 3 decimals: up to 0.0005 x BIN_S request-seconds off per bin
    # (a fast run's few milliseconds in flight are not within 0.1 % of that)
    rounding_s = len(tl["inflight"]) * 0.0005 * bench_plots.BIN_S
    assert in_flight_s == pytest.approx(sum(r["e2e_s"] for r in reqs), rel=1e-3, abs=rounding_s)
    st = plots["stages"]["series"]
    assert sorted(st["request"]) == sorted(float(r["index"]) for r in reqs)
    first = ["router_pick", "decode_hop"] if router else ["api_in", "prealloc"]  # composed vs the decode's own
    assert list(st)[1:3] == first and list(doc["summary"]["stages_ms"])[:2] == first
    for r in reqs:  # every request's stages add up to the time the server saw it (<= the client's E2E)
        assert 0 < sum(r["stages_ms"].values()) <= r["e2e_s"] * 1000.0 + 1.0
    if router:  # the prefill's stages, nested by the router, ran inside the decode's wait for the KV
        assert list(doc["summary"]["prefill_stages_ms"]) == ["api_in", *PREFILL_STAGES, "api_out"]
        # The router does not hold a decode's last frame for the prefill's answer: a request that
        # ends before that answer arrived has no prefill stages.
        with_prefill = [r for r in reqs if r["prefill_stages_ms"]]
        assert with_prefill
        for r in with_prefill:
            # Until its KV left, the prefill's stages fit in the decode's wait for it; its own
            # ``transfer`` ends when it sees the room succeed, which may be after the decode did.
            wait = sum(r["stages_ms"][k] for k in ("decode_hop", "decode.api_in", "decode.prealloc", "decode.kv_transfer"))
            p = r["prefill_stages_ms"]
            assert 0 < sum(p[k] for k in ("api_in", "bootstrap", "queue", "forward")) <= wait + 1.0, r
    else:
        assert doc["summary"]["prefill_stages_ms"] == {}


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> str:  # type: ignore[no-untyped-def]
    return tiny_model_factory("qwen3")


def test_cli_launch_fake_through_our_router(tmp_path: Path, tiny_dir: str) -> None:
    rc, doc, stdout = run_cli(tmp_path, tiny_dir, "fake", ["--max-concurrency", "3"])
    check_cli_report(rc, doc, stdout, tiny_dir, math.inf, router=True)
    assert doc["target"]["url"].startswith("http://127.0.0.1:")
    assert doc["summary"]["concurrency"] <= 3.0 + 1e-6


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed")
def test_cli_launch_mooncake_poisson(tmp_path: Path, tiny_dir: str) -> None:
    # No router: the bench fronts the pair itself (the baseline a router's overhead is measured on).
    rc, doc, stdout = run_cli(tmp_path, tiny_dir, "mooncake", ["--request-rate", "50", "--slo-ttft-ms", "1e9",
                                                                "--slo-tpot-ms", "1e9", "--router", "none"])
    check_cli_report(rc, doc, stdout, tiny_dir, 50.0, router=False)
    assert doc["target"]["url"] is None and doc["target"]["decode"] is not None
    starts = sorted(r["start_s"] for r in doc["requests"])
    assert starts[-1] > 0  # Poisson arrivals are spread, not all at 0
    assert doc["summary"]["goodput"]["good_requests"] == NUM  # SLOs nobody can miss


def test_cli_paired_direct_measures_the_router_per_pair(tmp_path: Path, tiny_dir: str) -> None:
    rc, doc, stdout = run_cli(tmp_path, tiny_dir, "fake", ["--router", "ours", "--paired-direct"])
    assert rc == 0, stdout[-3000:]
    s = doc["paired"]
    assert (s["pairs"], s["failed"]) == (NUM, 0)
    for side in ("through_router", "direct"):  # both legs of every pair answered, with a stream
        assert s[side]["e2e_ms"]["p50"] >= s[side]["ttft_ms"]["p50"] > 0
    added = s["added_ms"]["e2e"]
    assert added["p10"] <= added["p50"] <= added["p90"]
    # Read from /proc: a run this short may stay under one clock tick (10 ms) of router CPU.
    assert isinstance(s["router_cpu_s_per_1000"], float) and s["router_cpu_s_per_1000"] >= 0
    assert "added E2E per pair:" in stdout


def test_cli_bad_arguments() -> None:
    for args in (["--launch"], ["--prefill", "http://x"], ["--launch", "--make-tiny-model", "--prefill", "http://x"],
                 ["--make-tiny-model", "--request-rate", "0"], ["--url", "http://x", "--decode", "http://y"],
                 ["--make-tiny-model", "--url", "http://x"], ["--make-tiny-model", "--num-decode", "0"],
                 ["--make-tiny-model", "--router", "none", "--num-prefill", "2"],
                 ["--make-tiny-model", "--paired-direct", "--router", "none"], ["--url", "http://x", "--paired-direct"],
                 ["--make-tiny-model", "--paired-direct", "--endpoint", "completions"],
                 ["--make-tiny-model", "--peer-args", "--stream-interval 4"]):
        proc = subprocess.run([sys.executable, "-m", "common.cli", "bench", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 2 and "pdcluster bench:" in proc.stderr, (args, proc.stderr)
