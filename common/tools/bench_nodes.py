"""The nodes' side of a bench run: wait for idle, snapshot memory and scheduler counters before
and after, compare them (the leak check), and find the nodes behind our router."""
from __future__ import annotations

import time
import urllib.request

from common.tools import bench_report as report
from common.tools.local_cluster import get_json

IDLE_POLL_S = 0.1


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def wait_idle(url: str, timeout_s: float) -> tuple[dict, list[str]]:
    """Poll ``/debug/memory`` until the node holds nothing or the bound passes; (last report, problems)."""
    deadline = time.monotonic() + timeout_s
    while True:
        mem = get_json(url + "/debug/memory")
        problems = report.idle_problems(mem)
        if not problems or time.monotonic() > deadline:
            return mem, problems
        time.sleep(IDLE_POLL_S)


def snapshot(nodes: dict[str, str], idle_timeout_s: float) -> dict:
    """Each node's memory (after waiting for idle) and scheduler counters, by node name."""
    out: dict = {}
    for name, url in nodes.items():
        try:
            mem, problems = wait_idle(url, idle_timeout_s)
            counters = report.scheduler_counters(get_text(url + "/metrics"))
        except (OSError, ValueError) as exc:
            mem, problems, counters = {}, [f"could not read {url}: {type(exc).__name__}: {exc}"], {}
        out[name] = {"url": url, "memory": mem, "idle_problems": problems, "counters": counters}
    return out


def compare(before: dict, after: dict) -> dict:
    out = {}
    for name in before:
        b, a = before[name], after[name]
        out[name] = {
            "leak_problems": a["idle_problems"] + [p for p in report.leak_check(b["memory"], a["memory"])
                                                   if p not in a["idle_problems"]],
            "memory_changed": {k: list(v) for k, v in report.memory_diff(b["memory"], a["memory"]).items()},
            "counter_deltas": report.counter_deltas(b["counters"], a["counters"]),
        }
        out[name]["decode_step_split"] = report.decode_step_split(out[name]["counter_deltas"])
    return out


def format_nodes(cmp: dict) -> str:
    if not cmp:
        return "leak check: no node known (the router lists none in /workers)"
    lines = []
    for name, c in cmp.items():
        verdict = "clean" if not c["leak_problems"] else "PROBLEMS: " + "; ".join(c["leak_problems"])
        lines.append(f"leak check {name:<9} {verdict}")
        if c["memory_changed"]:
            lines.append("  memory changed: " + ", ".join(f"{k} {b} -> {a}" for k, (b, a) in c["memory_changed"].items()))
        if c["counter_deltas"]:
            lines.append("  scheduler counters: " + ", ".join(f"{k} +{v:g}" for k, v in c["counter_deltas"].items()))
        d = c["counter_deltas"]
        split = report.decode_step_split(d)
        if split is not None:
            lines.append(report.format_step_split(split))
        if d.get("forwards_total"):
            lines.append(f"  mean prefill forward: {1000 * d.get('forward_seconds_total', 0) / d['forwards_total']:.2f} ms"
                         f" over {d['forwards_total']:g} forwards")
    return "\n".join(lines)


def router_nodes(url: str) -> dict[str, str]:
    """The nodes behind a router, named by role and order, from our router's ``/workers``; empty
    for a router without it (the leak check then covers no node, and says so)."""
    try:
        workers = get_json(url + "/workers")["workers"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out: dict[str, str] = {}
    for role in ("prefill", "decode"):
        urls = sorted(w["url"] for w in workers if w.get("role") == role)
        out.update({f"{role}{i}": u for i, u in enumerate(urls)})
    return out
