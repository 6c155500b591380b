"""Prometheus text for ``GET /metrics``: the API's own counters plus the scheduler's gauges.

The API counts what it sees (requests by endpoint and status, tokens in and out, time to first
token, end-to-end latency, output tokens/s over a sliding window). The scheduler's numbers (queue
lengths, KV usage, generation throughput) come from its ``"metrics"`` QueryReply and are written
as gauges ``pdc_scheduler_<name>``; if the scheduler does not answer in time they are left out
and ``pdc_scheduler_up`` is 0.
"""
from __future__ import annotations

import math
import re
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ApiMetrics:
    def __init__(self, role: str, model_name: str, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"role": role, "model_name": model_name}
        names = list(self._labels)
        self.requests = Counter("pdc_api_requests", "HTTP generation requests finished", names + ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("pdc_api_prompt_tokens", "prompt tokens of finished sequences", names,
                                     registry=self.registry)
        self.generation_tokens = Counter("pdc_api_generation_tokens", "tokens generated", names,
                                         registry=self.registry)
        self.cached_tokens = Counter("pdc_api_cached_tokens", "prompt tokens served from the prefix cache",
                                     names, registry=self.registry)
        self.inflight = Gauge("pdc_api_inflight_sequences", "sequences the API waits on", names,
                              registry=self.registry)
        self.ttft = Histogram("pdc_api_time_to_first_token_seconds", "arrival to first output token", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdc_api_e2e_request_latency_seconds", "arrival to the last sequence's end", names,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stage = Histogram("pdc_api_stage_seconds", "time a finished sequence spent in each stage "
                               "(common/timeline.py)", names + ["stage"], buckets=_STAGE_BUCKETS,
                               registry=self.registry)
        self.throughput = Gauge("pdc_api_generation_tokens_per_second",
                                f"tokens generated per second over the last {window_s:g} s", names,
                                registry=self.registry)
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens)

    def l(self, **extra: str) -> dict[str, str]:  # noqa: E743 - short on purpose, used a lot
        return {**self._labels, **extra}

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        self.generation_tokens.labels(**self._labels).inc(n)
        now = time.monotonic()
        self._recent.append((now, n))
        self._trim(now)  # here too: a node nobody scrapes must not grow one entry per output

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()

    def _update_throughput(self) -> None:
        self._trim(time.monotonic())
        self.throughput.labels(**self._labels).set(sum(n for _, n in self._recent) / self._window_s)

    def render(self, scheduler: dict | None) -> bytes:
        self._update_throughput()
        text = generate_latest(self.registry)
        return text + scheduler_gauges(scheduler, self._labels).encode()


def scheduler_gauges(payload: dict | None, labels: dict[str, str]) -> str:
    """Prometheus exposition lines for a flat {name: number} dict (non-numbers skipped)."""
    lab = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    lines = ["# HELP pdc_scheduler_up 1 when the scheduler answered the metrics query",
             "# TYPE pdc_scheduler_up gauge",
             f"pdc_scheduler_up{{{lab}}} {0 if payload is None else 1}"]
    for key, val in sorted((payload or {}).items()):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            continue
        name = "pdc_scheduler_" + _NAME_OK.sub("_", str(key))
        lines += [f"# HELP {name} scheduler gauge {key}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {float(val)!r}"]
    return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
