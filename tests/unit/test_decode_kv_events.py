"""The decode's prefix cache publishes KV events through the prefill's wiring
(common/node/kv_events.py): only with its cache on, only on TP rank 0, advertised in the ready
report (/server_info), with the snapshot, and /flush_cache emits ``cleared`` (tiny model, fake data
plane, loopback ZMQ; no node processes)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import zmq

from common.config import KVEventsConfig, NodeConfig, resolve
from common.ipc.protocol import IpcEndpoints
from common.kv_events import AllCleared, BlockStored, EventCodec, KVEventBatch, block_hashes
from common.node.kv_events import start_publisher
from common.node.process import NodeProcess
from decode_node.__main__ import build_parser, config_from_args
from decode_node.process import DecodePart

PAGE = 16


def decode_config(model: str, *flags: str) -> NodeConfig:
    ns = build_parser().parse_args(["--model-path", model, "--disaggregation-transfer-backend", "fake",
                                    "--max-total-tokens", "512", "--page-size", str(PAGE), *flags])
    return resolve(config_from_args(ns))


def decode_process(cfg: NodeConfig, directory: str) -> NodeProcess:
    part = DecodePart(cfg.sched, cfg.transfer, cfg.cache.max_running_requests, kv_events=cfg.kv_events)
    return NodeProcess(cfg, part, IpcEndpoints.fresh(directory))


@pytest.fixture
def cached_decode(tiny_qwen3: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    cfg = decode_config(tiny_qwen3, "--disaggregation-decode-enable-radix-cache")
    proc = decode_process(cfg, str(tmp_path_factory.mktemp("ipc")))
    try:
        yield proc
    finally:
        proc.close()


def finish_request(proc: NodeProcess, ids: list[int]) -> None:
    """What a finished request does to the decode's memory: its row, then release into the cache."""
    mem = proc.runner.memory
    kv = mem.admit(ids, use_cache=True)
    assert kv is not None and mem.reserve(kv, len(ids))
    kv.kv_len = len(ids)
    mem.release(kv, ids)


def next_batch(sub: zmq.Socket, codec: EventCodec, proc: NodeProcess, deadline_s: float = 10.0) -> KVEventBatch:
    """The next batch with events, turning the loop (``observe_step``) until one arrives."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        proc.stats.observe_step(0.0)
        if sub.poll(50):
            batch = codec.decode(sub.recv())
            if batch.events:
                return batch
    raise AssertionError("no KV-event batch arrived")


def test_the_decode_cache_publishes_stored_snapshot_and_cleared(cached_decode: NodeProcess) -> None:
    proc = cached_decode
    info = proc.ready_info()["kv_events"]
    assert info["block_size"] == PAGE and info["endpoint"] == f"tcp://{info['host']}:{info['port']}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info["endpoint"])
    codec = EventCodec(None)
    try:
        # A heartbeat first: the subscription is in place, so no batch below can be lost to it.
        end = time.monotonic() + 10.0
        while not sub.poll(50):
            assert time.monotonic() < end, "no heartbeat from the decode's publisher"
            proc.stats.observe_step(0.0)
        sub.recv()

        ids = list(range(100, 141))  # 41 tokens: two whole pages cached, the tail page freed
        finish_request(proc, ids)
        batch = next_batch(sub, codec, proc)
        want = block_hashes(ids[: 2 * PAGE], PAGE)
        assert batch.role == "decode" and batch.instance_id == info["instance_id"]
        assert batch.events == [BlockStored(parent_hash=None, block_hashes=want)]
        snap = proc.stats.kv_snapshot()
        assert snap["role"] == "decode" and snap["seq"] == batch.seq and sorted(snap["blocks"]) == sorted(want)

        ok, _ = proc.stats.flush_cache()
        assert ok
        cleared = next_batch(sub, codec, proc)
        assert cleared.events == [AllCleared()] and cleared.seq == batch.seq + 1
        assert proc.stats.kv_snapshot()["blocks"] == []
        metrics = proc.stats.metrics()
        assert metrics["kv_events_cleared_total"] == 1 and metrics["kv_events_blocks"] == 0
    finally:
        sub.close(linger=0)
        ctx.term()


def test_without_its_cache_the_decode_publishes_nothing(tiny_qwen3: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = decode_config(tiny_qwen3)  # the decode's cache is off by default
    assert not cfg.kv_events.enabled
    proc = decode_process(cfg, str(tmp_path_factory.mktemp("ipc")))
    try:
        assert "kv_events" not in proc.ready_info()
        assert "error" in proc.stats.kv_snapshot()
        assert not any(k.startswith("kv_events_") for k in proc.stats.metrics())
    finally:
        proc.close()
    off = decode_config(tiny_qwen3, "--disaggregation-decode-enable-radix-cache", "--disable-kv-events")
    assert off.cache.enable_prefix_cache and not off.kv_events.enabled


def test_only_tp_rank_0_with_its_cache_on_publishes() -> None:
    """Every rank's cache holds the same blocks: one publisher per node, never one per rank."""
    def runner(first: bool, enabled: bool) -> SimpleNamespace:
        cache = SimpleNamespace(enabled=enabled, page_size=PAGE, events=None)
        return SimpleNamespace(memory=SimpleNamespace(cache=cache), tp=SimpleNamespace(is_first=first))

    for first, enabled, on in ((False, True, True), (True, False, True), (True, True, False)):
        r = runner(first, enabled)
        assert start_publisher(KVEventsConfig(enabled=on), "decode", r, "127.0.0.1", None) is None  # type: ignore[arg-type]
        assert r.memory.cache.events is None
    r = runner(True, True)
    pub = start_publisher(KVEventsConfig(), "decode", r, "127.0.0.1", None)  # type: ignore[arg-type]
    assert pub is not None
    try:
        assert r.memory.cache.events is pub.log and pub.log.role == "decode"
    finally:
        pub.close()
