"""A write through the Mooncake data plane cannot poison the prefix cache: real processes, the
real Mooncake TCP engine, and an attacker engine in this test process.

The attacker does what anyone on the pod network can (docs/OPERATIONS.md, threat model): it looks
up the prefill's Mooncake session in the bootstrap registry, asks Mooncake's handshake for the
first buffer the prefill registered (the K of layer 0) and overwrites its first pages with
garbage, where an idle pool keeps the prefix cache of the prompt just served. The same prompt
sent again must come back equal to HF greedy token for token, recomputed rather than read from
the poisoned pages, with the prefill's integrity-failure metric counting it; the node ends idle.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.cluster import Cluster, check_greedy, metric, running_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

mooncake = pytest.importorskip("mooncake.engine")

PROMPT = [(13 * k + 7) % 500 + 10 for k in range(70)]  # 4 full pages of 16 and 6 tokens
N = 8
POISONED_PAGES = 16  # pages 1..16 of layer 0's K: the idle pool's first pages, where PROMPT was cached


@pytest.fixture(scope="module")
def cluster(tiny_qwen3: str) -> Iterator[Cluster]:
    with running_cluster(tiny_qwen3) as c:
        yield c


def generate(cluster: Cluster) -> tuple[list[int], int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    p, d = cluster.pd("/generate", body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    out = d.json()
    return out["output_ids"], int(out["meta_info"]["cached_tokens"])


def page_bytes(cluster: Cluster) -> int:
    info = httpx.get(cluster.prefill.url + "/server_info", timeout=10).json()
    cfg = httpx.get(cluster.prefill.url + "/model_info", timeout=10).json()
    assert info["page_size"] == 16, info
    import json
    import os

    with open(os.path.join(cluster.model_dir, "config.json")) as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    del cfg
    return info["page_size"] * hf["num_key_value_heads"] * head_dim * 4  # float32


def test_garbage_written_into_the_prefills_cached_pages_is_never_served(cluster: Cluster) -> None:
    first, cached = generate(cluster)
    check_greedy(cluster.model_dir, PROMPT, first, N, "before the attack")
    again, cached = generate(cluster)
    assert again == first and cached == 64, cached  # served from the prefix cache
    failures = metric(cluster.prefill.url, "pdc_scheduler_kv_integrity_failures_total")

    routes = httpx.get(f"http://127.0.0.1:{cluster.bootstrap_port}/routes", timeout=10).json()
    session = routes[0]["session_id"]
    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    size = POISONED_PAGES * page_bytes(cluster)
    garbage = ctypes.create_string_buffer(b"\x7f" * size, size)
    assert engine.register_memory(ctypes.addressof(garbage), size) == 0
    target = engine.get_first_buffer_address(session)
    assert target, "the handshake named no buffer"
    offset = page_bytes(cluster)  # page 0 is reserved; the first pages handed out start at 1
    assert engine.batch_transfer_sync_write(session, [ctypes.addressof(garbage)], [target + offset], [size]) == 0

    after, cached = generate(cluster)
    check_greedy(cluster.model_dir, PROMPT, after, N, "after garbage was written into the cached pages")
    assert cached < 64, f"the poisoned prefix was served ({cached} cached tokens)"
    assert metric(cluster.prefill.url, "pdc_scheduler_kv_integrity_failures_total") >= failures + 1
    cluster.wait_idle()
