"""Shared fixtures: tiny random-weight checkpoints, built once per test session.

    tiny_qwen3, tiny_llama     paths of the default checkpoints (seed 0)
    tiny_lfm2                  the hybrid (short conv + attention, recurrent state) checkpoint
    tiny_model_dir             the same, parametrized over both archs (a test using it runs twice)
    tiny_model_factory(arch, seed=0, **overrides) -> path, cached per arguments

The HF reference (``hf_greedy``) lives in ``tests/reference.py``.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

# Several test sessions share two cores; tiny models gain nothing from more threads. Set before
# torch is imported so child processes (which inherit the environment) get it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# tokenizers warns on stderr when a process forks after using its thread pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_ARCHS = ("qwen3", "llama")


def pytest_collection_finish(session: pytest.Session) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Build (once per distinct arguments) a tiny checkpoint and return its directory."""
    from common.tools.make_tiny_model import make_tiny_model

    cache: dict[tuple[Any, ...], str] = {}

    def make(arch: str = "qwen3", seed: int = 0, **overrides: Any) -> str:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-s{seed}")
            cache[key] = make_tiny_model(str(out), arch=arch, seed=seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_lfm2(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("lfm2")


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory(request.param)
