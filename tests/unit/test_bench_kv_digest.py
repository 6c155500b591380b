"""The KV-digest cost tool runs the real engine and the real digests and leaves the pool as it
found it; bad arguments exit 2."""
from __future__ import annotations

import re

import pytest

from common.tools import bench_kv_digest


def test_prints_the_forward_the_digest_and_their_ratio(tiny_qwen3: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_kv_digest.main(["--model-path", tiny_qwen3, "--tokens", "37", "--repeat", "2"]) == 0
    line = capsys.readouterr().out
    m = re.search(r"prefill forward ([0-9.]+) ms, digest of its ([0-9.]+) MiB of KV ([0-9.]+) ms .* = ([0-9.]+) %", line)
    assert m and float(m.group(1)) > 0 and float(m.group(3)) > 0, line


def test_bad_arguments_exit_2(tiny_qwen3: str) -> None:
    assert bench_kv_digest.main(["--model-path", tiny_qwen3, "--tokens", "0"]) == 2
    assert bench_kv_digest.main(["--model-path", tiny_qwen3 + "-missing"]) == 2
