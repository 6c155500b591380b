"""deploy/grafana/pdcluster.json cannot drift from the metrics the code exports: every metric name
its PromQL uses, and every label it groups by or prints, must exist.

The exported set is built from the code itself: the router's registry (router/metrics.py), a
node API process's registry (common/server/metrics.py), and the ``pdc_scheduler_*`` gauges that
the real prefill and decode schedulers report (their Stats objects over unit-test rigs).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from common.server.metrics import ApiMetrics, scheduler_gauges
from router.metrics import RouterMetrics
from router.workers import Worker
from tests.unit.test_decode_scheduler import Rig
from tests.unit.test_prefill_scheduler import Node

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdcluster.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("", "_sum", "_count", "_created")}
SCRAPE_LABELS = {"instance", "job", "le"}  # added by Prometheus, or part of every histogram


def _registry_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry can expose, from its families' types (even with no sample yet)."""
    return {fam.name + suffix for fam in registry.collect() for suffix in SUFFIXES[fam.type]}


def _labels(text: str) -> set[str]:
    return {k for fam in text_string_to_metric_families(text) for s in fam.samples for k in s.labels}


def exported() -> tuple[set[str], set[str]]:
    """(metric names, label names) our processes export."""
    router = RouterMetrics(lambda: [Worker("http://p:1", "prefill"), Worker("http://d:2", "decode")])
    router.requests.labels("generate", "200").inc()
    router.errors.labels("generate", "timeout").inc()
    router.retries.labels("generate").inc()
    router.ttft.labels("generate").observe(0.1)
    router.latency.labels("generate").observe(0.2)
    router.stage.labels("generate", "decode.kv_transfer").observe(0.01)
    router.kv_events.labels("http://p:1", "applied").inc()
    router.prediction(16, 16)
    from router.kv_index import KVIndex

    router.watch_kv(KVIndex(), {"prefill": lambda: {"exact": 1}, "decode": lambda: {"exact": 1}})
    api = ApiMetrics("decode", "m")
    api.on_request("generate", 200)
    api.on_sequence(16, 0, {"prealloc": 1.0})
    gauges = {**Node().stats.metrics(), **Rig().stats.metrics()}
    gauge_text = scheduler_gauges(gauges, {"role": "decode", "model_name": "m"})
    names = _registry_names(router.registry) | _registry_names(api.registry)
    names |= {s.name for fam in text_string_to_metric_families(gauge_text) for s in fam.samples}
    labels = _labels(router.render().decode()) | _labels(api.render(gauges).decode())
    return names, labels


def queries() -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend format) of every target."""
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in panels for t in p.get("targets", [])]


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    names, _ = exported()
    assert "pdc_scheduler_decode_steps_total" in names and "pdc_router_worker_routed_total" in names
    assert len(queries()) >= 20
    for title, expr, _ in queries():
        used = set(re.findall(r"\bpdc_[a-zA-Z0-9_]+", expr))
        assert used, f"{title}: {expr} reads no pdcluster metric"
        assert used <= names, f"panel {title!r} queries {sorted(used - names)}, which nothing exports"


def test_every_label_the_dashboard_groups_by_or_prints_is_exported() -> None:
    _, labels = exported()
    allowed = labels | SCRAPE_LABELS
    assert {"worker", "role", "status", "reason", "endpoint", "model_name"} <= labels
    for title, expr, legend in queries():
        grouped = {x.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for x in g.split(",")}
        matched = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", expr))
        printed = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        unknown = (grouped | matched | printed) - allowed - {""}
        assert not unknown, f"panel {title!r} uses labels {sorted(unknown)}, which no metric carries"


def test_dashboard_is_importable_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pdcluster" and dash["title"]
    ds = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds and ds[0]["query"] == "prometheus"  # the operator picks their Prometheus at import
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"] and all(t["refId"] for t in p["targets"]), p["title"]


@pytest.mark.parametrize("doc", ["docs/OPERATIONS.md"])
def test_operations_doc_points_at_the_dashboard(doc: str) -> None:
    assert "deploy/grafana/pdcluster.json" in (ROOT / doc).read_text()
