"""Fixtures of the e2e tier; the helpers (process start/kill, router-shaped requests, idle-memory
checks, the HF comparison) live in ``tests/e2e/cluster.py``.

    pd_cluster   a prefill node + a decode node over real Mooncake TCP on loopback, one per tiny
                 arch (tests using it run for qwen3 and llama); shared by the tests of a module,
                 torn down (process groups killed) when the module is done with that arch. The
                 llama pair's decode streams every 3 tokens (--stream-interval 3), so every
                 streamed check in those tests also runs on multi-token chunks
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.cluster import Cluster, running_cluster


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pd_cluster(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> Iterator[Cluster]:
    decode_args = ["--stream-interval", "3"] if request.param == "llama" else []
    with running_cluster(tiny_model_factory(request.param), decode_args=decode_args) as c:
        yield c
