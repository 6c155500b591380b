"""The router's Prometheus metrics (its own registry, served at ``/metrics``).

    pdc_router_requests_total{endpoint,status}        every client request, by its final status
    pdc_router_errors_total{endpoint,reason}          why the failed ones failed (router's view)
    pdc_router_retries_total{endpoint}                extra tries on another pair
    pdc_router_ttft_seconds{endpoint}                 arrival -> first byte to the client
    pdc_router_request_seconds{endpoint}              arrival -> last byte to the client
    pdc_router_worker_{healthy,inflight,load,routed}{worker,role}   read from the worker set at scrape
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.workers import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdc_router_requests", "client requests by final status", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("pdc_router_errors", "failed client requests by reason", ["endpoint", "reason"],
                              registry=r)
        self.retries = Counter("pdc_router_retries", "tries on another pair after a failure", ["endpoint"], registry=r)
        self.ttft = Histogram("pdc_router_ttft_seconds", "arrival to first byte sent", ["endpoint"], buckets=_BUCKETS,
                              registry=r)
        self.latency = Histogram("pdc_router_request_seconds", "arrival to last byte sent", ["endpoint"],
                                 buckets=_BUCKETS, registry=r)
        r.register(_WorkerCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
