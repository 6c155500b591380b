"""The router's Prometheus metrics (its own registry, served at ``/metrics``).

    pdc_router_requests_total{endpoint,status}        every client request, by its final status
    pdc_router_errors_total{endpoint,reason}          why the failed ones failed (router's view)
    pdc_router_retries_total{endpoint}                extra tries on another pair
    pdc_router_client_requests_total{client,status}   by the caller's key name (router/clients.py)
    pdc_router_ttft_seconds{endpoint}                 arrival -> first byte to the client
    pdc_router_request_seconds{endpoint}              arrival -> last byte to the client
    pdc_router_worker_{healthy,inflight,load,routed}{worker,role}   read from the worker set at scrape

With ``--tokenizer-path`` (exact cache-aware routing, router/kv_index.py; the decode ones with
``--decode-policy cache-aware``):

    pdc_router_kv_events_total{worker,verdict}        KV-event frames and subscription events: applied,
                                                      heartbeat, buffered, snapshot; dropped: malformed,
                                                      unauthenticated, replayed; resyncs: gap, restarted;
                                                      lost: silent, error, bad_snapshot, no_publisher
    pdc_router_kv_picks_total{mode}                   prefill picks: exact, unsynced / no_tokens (by load)
    pdc_router_kv_predictions_total{outcome}          single-sequence requests whose prefill reported its
                                                      cached tokens: exact, over, under (the prediction)
    pdc_router_kv_predicted_tokens_total              predicted cache hits (tokens) of those requests
    pdc_router_kv_reported_cached_tokens_total        cached tokens their prefills reported
    pdc_router_kv_decode_picks_total{mode}            decode picks: the same modes
    pdc_router_kv_decode_predicted_tokens_total       predicted decode prefix hits (tokens) of single-sequence
                                                      requests a decode took: what they should add to its
                                                      pdc_decode_reused_tokens_total
    pdc_router_kv_decode_predictions_total{outcome}   those whose decode reported decode_reused_tokens in its
                                                      answer: exact, over, under (the prediction)
    pdc_router_kv_decode_reported_tokens_total        the decode_reused_tokens those answers reported
    pdc_router_kv_index_{blocks,synced}{worker}       the index per worker (prefill or decode), read at scrape
    pdc_router_decode_local_total{endpoint}           requests sent to a decode alone, which computed the
                                                      rest of their prompt (--decode-local-prefill-tokens)

``RecentLatency`` keeps the last minute of streamed requests' TTFT and TPOT per worker for the
live page (router/dashboard.py); Prometheus users get the same from the histograms.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.kv_index import KVIndex
from router.workers import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], list[Worker]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator:
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("pdc_router_worker_healthy", "1 while the worker is in rotation", labels=labels)
        inflight = GaugeMetricFamily("pdc_router_worker_inflight", "requests the router has on the worker", labels=labels)
        load = GaugeMetricFamily("pdc_router_worker_load", "in-flight plus load the node reports beyond it",
                                 labels=labels)
        routed = CounterMetricFamily("pdc_router_worker_routed", "requests (tries) sent to the worker", labels=labels)
        for w in self._workers():
            lv = [w.url, w.role]
            healthy.add_metric(lv, float(w.healthy and not w.draining))
            inflight.add_metric(lv, w.inflight)
            load.add_metric(lv, w.load)
            routed.add_metric(lv, w.routed)
        yield from (healthy, inflight, load, routed)


class _KVCollector(Collector):
    def __init__(self, index: KVIndex, picks: dict[str, Callable[[], dict[str, int]]]) -> None:
        self._index = index
        self._picks = picks  # by role: each exact policy's picks by mode

    def collect(self) -> Iterator:
        blocks = GaugeMetricFamily("pdc_router_kv_index_blocks", "blocks the worker's cache holds, per the "
                                   "router's index", labels=["worker"])
        synced = GaugeMetricFamily("pdc_router_kv_index_synced", "1 while the index follows the worker's "
                                   "events", labels=["worker"])
        for url, idx in sorted(self._index.workers.items()):
            blocks.add_metric([url], len(idx.blocks))
            synced.add_metric([url], float(idx.synced))
        yield from (blocks, synced)
        for role, name in (("prefill", "pdc_router_kv_picks"), ("decode", "pdc_router_kv_decode_picks")):
            if role not in self._picks:
                continue
            picks = CounterMetricFamily(name, f"{role} picks of exact cache-aware routing by mode "
                                        "(unsynced and no_tokens went by load)", labels=["mode"])
            for mode, n in sorted(self._picks[role]().items()):
                picks.add_metric([mode], n)
            yield picks


class RecentLatency:
    """Per worker, the TTFT (taken at a stream's first frame) and TPOT (at its end) of streamed
    requests in the last ``window_s`` (at most ``max_samples`` each): count, p50 and p90.

    Streams only: a JSON answer's first byte is its last, so it has no TTFT of its own. TPOT is
    what a client sees, as ``pdcluster bench`` computes it: ``(last frame - first frame) / (tokens - 1)``
    per sequence, the token count from the stream's last frame (``stream_tokens``).
    """

    def __init__(self, window_s: float = 60.0, max_samples: int = 1024) -> None:
        self.window_s = window_s
        self._max = max_samples
        self._samples: dict[tuple[str, str], deque[tuple[float, float]]] = {}  # (url, kind) -> (when, s)

    def observe(self, url: str, kind: str, seconds: float, now: float | None = None) -> None:
        q = self._samples.setdefault((url, kind), deque(maxlen=self._max))
        q.append((time.monotonic() if now is None else now, seconds))

    def first_token(self, urls: tuple[str, ...], ttft_s: float) -> None:
        """A stream's first frame reached the client: its TTFT counts for each worker that served it."""
        for url in urls:
            self.observe(url, "ttft", ttft_s)

    def stream_ended(self, url: str, first: float, last: float, tokens: float) -> None:
        """A stream ended on decode worker ``url``; ``first``/``last``: monotonic times of its first
        and last frame; ``tokens``: per sequence (``stream_tokens``)."""
        if tokens >= 2 and last > first:
            self.observe(url, "tpot", (last - first) / (tokens - 1), last)

    def summary(self, url: str, kind: str, now: float | None = None) -> dict[str, float | int | None]:
        now = time.monotonic() if now is None else now
        q = self._samples.get((url, kind))
        while q and q[0][0] < now - self.window_s:
            q.popleft()
        if not q:
            self._samples.pop((url, kind), None)  # forgotten workers do not linger
            return {"n": 0, "p50": None, "p90": None}
        values = sorted(v for _, v in q)
        return {"n": len(values), "p50": _quantile(values, 0.5), "p90": _quantile(values, 0.9)}


def stream_tokens(last_frames: bytes, frames: int, sequences: int) -> float:
    """Tokens per sequence of a finished stream: what its last data frame states (/generate:
    ``meta_info.completion_tokens`` of that sequence; OpenAI with ``include_usage``: the usage over
    all sequences), else one token per frame, which is what our nodes send when they keep up."""
    data = [f for f in last_frames.split(b"\n\n") if f.startswith(b"data: ") and f != b"data: [DONE]"]
    try:
        obj = json.loads(data[-1][6:]) if data else None
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        meta, usage = obj.get("meta_info"), obj.get("usage")
        if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
            return float(meta["completion_tokens"])
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return usage["completion_tokens"] / max(sequences, 1)
    return frames / max(sequences, 1)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on a sorted list."""
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdc_router_requests", "client requests by final status", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("pdc_router_errors", "failed client requests by reason", ["endpoint", "reason"],
                              registry=r)
        self.retries = Counter("pdc_router_retries", "tries on another pair after a failure", ["endpoint"], registry=r)
        # By the keys file's client names (bounded: unknown callers are one label, "-").
        self.client_requests = Counter("pdc_router_client_requests", "requests by client and status",
                                       ["client", "status"], registry=r)
        self.ttft = Histogram("pdc_router_ttft_seconds", "arrival to first byte sent", ["endpoint"], buckets=_BUCKETS,
                              registry=r)
        self.latency = Histogram("pdc_router_request_seconds", "arrival to last byte sent", ["endpoint"],
                                 buckets=_BUCKETS, registry=r)
        # Each stage of a finished request's timeline (router/timeline.py), decode's included.
        self.stage = Histogram("pdc_router_stage_seconds", "time finished requests spent in each stage",
                               ["endpoint", "stage"], buckets=_STAGE_BUCKETS, registry=r)
        r.register(_WorkerCollector(workers))
        self.recent = RecentLatency()
        self.kv_events = Counter("pdc_router_kv_events", "KV-event frames and subscription events by verdict",
                                 ["worker", "verdict"], registry=r)
        self.kv_predictions = Counter("pdc_router_kv_predictions", "predicted vs reported prefill cache hits",
                                      ["outcome"], registry=r)
        self.kv_predicted = Counter("pdc_router_kv_predicted_tokens", "predicted prefill cache hits (tokens)",
                                    registry=r)
        self.kv_reported = Counter("pdc_router_kv_reported_cached_tokens", "cached tokens the prefills reported "
                                   "for the same requests", registry=r)
        self.kv_decode_predicted = Counter("pdc_router_kv_decode_predicted_tokens", "predicted decode prefix hits "
                                           "(tokens) of single-sequence requests a decode took", registry=r)
        self.kv_decode_predictions = Counter("pdc_router_kv_decode_predictions", "predicted vs reported decode "
                                             "prefix hits (decode_reused_tokens), per request", ["outcome"], registry=r)
        self.decode_local = Counter("pdc_router_decode_local", "requests sent to a decode alone (it computed "
                                    "the rest of the prompt past its cached prefix)", ["endpoint"], registry=r)
        self.kv_decode_reported = Counter("pdc_router_kv_decode_reported_tokens", "decode_reused_tokens the decodes "
                                          "reported for the same requests", registry=r)

    def watch_kv(self, index: KVIndex, picks: dict[str, Callable[[], dict[str, int]]]) -> None:
        """``picks``: by role, the exact policies' picks by mode."""
        self.registry.register(_KVCollector(index, picks))

    def prediction(self, predicted: int, reported: int) -> None:
        self.kv_predictions.labels(_outcome(predicted, reported)).inc()
        self.kv_predicted.inc(predicted)
        self.kv_reported.inc(reported)

    def decode_prediction(self, predicted: int, reported: int) -> None:
        self.kv_decode_predictions.labels(_outcome(predicted, reported)).inc()
        self.kv_decode_reported.inc(reported)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _outcome(predicted: int, reported: int) -> str:
    return "exact" if predicted == reported else "over" if predicted > reported else "under"
