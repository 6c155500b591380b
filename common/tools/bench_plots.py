"""PNG plots of a ``pdcluster bench`` run, written next to its JSON (``--json run.json`` gives
``run.latency.png``, ``run.timeline.png`` and, when the server sent stage timelines,
``run.stages.png``).

Each plot's series are also returned (and stored in the JSON under ``plots``), so what a picture
shows can be checked, or redrawn, without reading pixels:

    latency   CDFs of TTFT, ITL and E2E (ms; x sorted, y = fraction of samples <= x)
    timeline  output tokens/s and requests in flight over the run, in ``BIN_S`` bins
    stages    each completed request's timeline stages (ms), stacked, requests in send order

matplotlib runs on the Agg backend: no display, no GUI toolkit.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from common.tools.bench_client import RequestResult

BIN_S = 0.25  # the timeline plot's bin width
MAX_POINTS = 400  # a CDF keeps at most this many points (evenly spaced ranks)
MAX_BARS = 200  # the stages plot shows at most this many requests (evenly spaced)


def cdf(values: Sequence[float]) -> dict[str, list[float]]:
    xs = sorted(values)
    if len(xs) > MAX_POINTS:
        step = (len(xs) - 1) / (MAX_POINTS - 1)
        idx = [round(i * step) for i in range(MAX_POINTS)]
    else:
        idx = list(range(len(xs)))
    n = len(xs)
    return {"x": [round(xs[i], 3) for i in idx], "y": [round((i + 1) / n, 5) for i in idx]}


def latency_series(ok: Sequence[RequestResult]) -> dict[str, dict[str, list[float]]]:
    return {
        "ttft_ms": cdf([r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]),
        "itl_ms": cdf([x * 1000.0 for r in ok for x in r.itl_s]),
        "e2e_ms": cdf([r.e2e_s * 1000.0 for r in ok if r.e2e_s is not None]),
    }


def timeline_series(results: Sequence[RequestResult], duration_s: float) -> dict[str, list[float]]:
    """Tokens/s and in-flight requests per bin. A token's time is its request's send time plus
    TTFT plus the ITL samples before it (what the client saw)."""
    bins = max(1, int(duration_s / BIN_S) + 1)
    tokens = [0] * bins
    inflight = [0.0] * bins
    for r in results:
        if r.ttft_s is not None:
            t = r.start_s + r.ttft_s
            for gap in (0.0, *r.itl_s):
                t += gap
                tokens[min(int(t / BIN_S), bins - 1)] += 1
        end = r.start_s + (r.e2e_s if r.e2e_s is not None else 0.0)
        for b in range(bins):  # time this request was in flight within bin b, as a share of the bin
            lo, hi = b * BIN_S, (b + 1) * BIN_S
            inflight[b] += max(0.0, min(hi, end) - max(lo, r.start_s)) / BIN_S
    return {"t_s": [round(b * BIN_S, 3) for b in range(bins)], "tokens_per_s": [n / BIN_S for n in tokens],
            "inflight": [round(x, 3) for x in inflight]}


def stages_series(ok: Sequence[RequestResult]) -> dict[str, list[float]]:
    """One list per stage (ms), one entry per shown request; ``request`` holds their indices."""
    with_tl = sorted((r for r in ok if r.stages_ms), key=lambda r: r.start_s)
    if len(with_tl) > MAX_BARS:
        step = (len(with_tl) - 1) / (MAX_BARS - 1)
        with_tl = [with_tl[round(i * step)] for i in range(MAX_BARS)]
    names: dict[str, None] = {}
    for r in with_tl:
        names.update(dict.fromkeys(r.stages_ms))
    out: dict[str, list[float]] = {"request": [float(r.index) for r in with_tl]}
    for name in names:
        out[name] = [round(r.stages_ms.get(name, 0.0), 3) for r in with_tl]
    return out


def write_plots(json_path: str, results: Sequence[RequestResult], duration_s: float) -> dict[str, dict]:
    """Draw the plots next to ``json_path``; return ``{name: {"png": path, "series": ...}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = os.path.splitext(json_path)[0]
    ok = [r for r in results if r.ok]
    out: dict[str, dict] = {}

    series = latency_series(ok)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, label) in zip(axes, (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))):
        ax.plot(series[key]["x"], series[key]["y"], drawstyle="steps-post")
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    out["latency"] = _save(fig, f"{stem}.latency.png", series)

    series = timeline_series(results, duration_s)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(series["t_s"], series["tokens_per_s"], color="tab:blue", label="output tokens/s")
    ax.set(xlabel="s since the first request", ylabel="output tokens/s", title="throughput and requests in flight")
    ax2 = ax.twinx()
    ax2.plot(series["t_s"], series["inflight"], color="tab:orange", label="in flight")
    ax2.set(ylabel="requests in flight")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper right")
    out["timeline"] = _save(fig, f"{stem}.timeline.png", series)

    series = stages_series(ok)
    if len(series) > 1:
        fig, ax = plt.subplots(figsize=(11, 4.2))
        xs = range(len(series["request"]))
        bottom = [0.0] * len(series["request"])
        for name, values in series.items():
            if name == "request":
                continue
            ax.bar(xs, values, bottom=bottom, width=1.0, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(xlabel="requests in send order", ylabel="ms", title="where each request's time went")
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        out["stages"] = _save(fig, f"{stem}.stages.png", series)
    return out


def _save(fig: object, path: str, series: dict) -> dict:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=80)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return {"png": path, "series": series}


def write_goodput_plot(png_path: str, rows: Sequence[dict]) -> dict:
    """Goodput (and throughput of completed requests) against the Poisson arrival rate of a
    ``--request-rate-sweep``; ``rows`` are ``{"rate", "request_goodput", "request_throughput"}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"rate": [r["rate"] for r in rows], "request_goodput": [r["request_goodput"] for r in rows],
              "request_throughput": [r["request_throughput"] for r in rows]}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(series["rate"], series["request_goodput"], marker="o", label="goodput (meets the SLOs)")
    ax.plot(series["rate"], series["request_throughput"], marker="x", linestyle="--", label="completed")
    ax.plot(series["rate"], series["rate"], color="grey", linewidth=0.8, label="offered")
    ax.set(xlabel="arrival rate (req/s, Poisson)", ylabel="req/s", title="goodput against arrival rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, png_path, series)
