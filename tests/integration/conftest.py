"""Fixtures of the integration tier.

    alphabet     the fake scheduler's token ids (tests/integration/_fake_scheduler.py)
    api_nodes    a decode and a prefill API process, each over a fake scheduler process
                 (tests/integration/test_api_process.py spawns them): one pair for the session,
                 so test_api_process and test_api_process_errors share its start-up
    tok          the tiny model's tokenizer
    decode       the pair's decode node, healthy; a fresh one if a test killed its scheduler
                 (test_scheduler_death_fails_requests_with_503 does, last in its file)
    prefill      the pair's prefill node, healthy
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from common.tokenizer import Tokenizer
from tests.integration.test_api_process import WORDS, Node, spawn_node, stop_node, wait_healthy


@pytest.fixture(scope="session")
def alphabet(tiny_qwen3: str) -> list[int]:
    # The bare Rust tokenizer: no transformers import before the node processes start.
    from tokenizers import Tokenizer as RustTokenizer

    rust = RustTokenizer.from_file(os.path.join(tiny_qwen3, "tokenizer.json"))
    return [rust.encode(w, add_special_tokens=False).ids[0] for w in WORDS]


def _spawn_decode(tmp_path_factory: pytest.TempPathFactory, model_dir: str, alphabet: list[int]) -> Node:
    # The decode watches its scheduler's pid, so killing that scheduler turns the node 503.
    return spawn_node(tmp_path_factory.mktemp("decode"), model_dir, "decode", alphabet, step_s=0.005,
                      watch_scheduler=True)


@pytest.fixture(scope="session")
def api_nodes(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: str, alphabet: list[int]) -> Iterator[dict[str, Node]]:
    """Both roles, started together (start-up is mostly imports; they overlap)."""
    started: dict[str, Node] = {}
    try:
        started["decode"] = _spawn_decode(tmp_path_factory, tiny_qwen3, alphabet)
        started["prefill"] = spawn_node(tmp_path_factory.mktemp("prefill"), tiny_qwen3, "prefill", alphabet,
                                        step_s=0.3)
        yield started
    finally:
        for node in started.values():
            stop_node(node)


@pytest.fixture(scope="session")
def tok(tiny_qwen3: str, api_nodes: dict[str, Node]) -> Tokenizer:
    return Tokenizer(tiny_qwen3)  # loads while the nodes start


@pytest.fixture
def decode(api_nodes: dict[str, Node], tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: str,
           alphabet: list[int]) -> Node:
    node = api_nodes["decode"]
    if node.fake.poll() is not None:  # its scheduler was killed by a test: later tests get a live pair
        stop_node(node)
        node = api_nodes["decode"] = _spawn_decode(tmp_path_factory, tiny_qwen3, alphabet)
    wait_healthy(node)
    return node


@pytest.fixture
def prefill(api_nodes: dict[str, Node], tok: Tokenizer) -> Node:
    wait_healthy(api_nodes["prefill"])
    return api_nodes["prefill"]
