"""Prometheus text for ``GET /metrics``: the API's own counters plus the scheduler's gauges.

The API counts what it sees (requests by endpoint and status, tokens in and out, time to first
token, end-to-end latency, output tokens/s over a sliding window). The scheduler's numbers (queue
lengths, KV usage, generation throughput) come from its ``"metrics"`` QueryReply and are written
as gauges ``pdc_scheduler_<name>`` (a name that starts with ``pdc_`` as it is); if the scheduler does not answer in time they are left out
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
        # Tokens per whole second of monotonic time, oldest first: one entry per second, however
        # many outputs arrive in it (on_tokens runs once per output, so it stays a few attribute
        # lookups: children are bound here once, not looked up by label on every call).
        self._recent: deque[list[int]] = deque()  # [second, tokens]
        lab = self._labels
        self._tokens_out = self.generation_tokens.labels(**lab)
        self._prompt = self.prompt_tokens.labels(**lab)
        self._cached = self.cached_tokens.labels(**lab)
        self._inflight = self.inflight.labels(**lab)
        self._ttft = self.ttft.labels(**lab)
        self._e2e = self.e2e.labels(**lab)
        self._throughput = self.throughput.labels(**lab)
        self._stages: dict[str, Histogram] = {}  # stage -> its labelled child, bound on first use
        self._tokens_pending = 0

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        self._tokens_pending += n  # into the counter at the next render: a lock-free int add here
        sec = int(time.monotonic())
        recent = self._recent
        if recent and recent[-1][0] == sec:
            recent[-1][1] += n
            return
        recent.append([sec, n])
        self._trim(sec)  # here too: a node nobody scrapes must not grow without bound

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_inflight(self, delta: int) -> None:
        self._inflight.inc(delta)

    def on_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(**self._labels, endpoint=endpoint, status=str(status)).inc()

    def on_sequence(self, prompt_tokens: int, cached_tokens: int, stages_ms: dict[str, float]) -> None:
        """A sequence that finished without error."""
        self._prompt.inc(prompt_tokens)
        self._cached.inc(cached_tokens)
        for stage, ms in stages_ms.items():
            child = self._stages.get(stage)
            if child is None:
                child = self._stages[stage] = self.stage.labels(**self._labels, stage=stage)
            child.observe(ms / 1000.0)

    def on_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def _trim(self, now_s: int) -> None:
        # The last window_s whole seconds count, the current (partial) one included.
        while self._recent and self._recent[0][0] <= now_s - self._window_s:
            self._recent.popleft()

    def _update_throughput(self) -> None:
        pending, self._tokens_pending = self._tokens_pending, 0
        self._tokens_out.inc(pending)
        self._trim(int(time.monotonic()))
        self._throughput.set(sum(n for _, n in self._recent) / self._window_s)

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
        key = _NAME_OK.sub("_", str(key))
        # A scheduler may name a metric in full (e.g. pdc_decode_reused_tokens_total); the rest
        # are its gauges under pdc_scheduler_.
        name = key if key.startswith("pdc_") else "pdc_scheduler_" + key
        lines += [f"# HELP {name} scheduler gauge {key}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {float(val)!r}"]
    return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
