"""A soak: our router in front of 1 prefill + 1 decode node at saturation (a closed loop of
``concurrency`` streams) for a while, the resident memory of every process sampled.

Flat means: for each process, the highest RSS of the last third of the run is at most the highest
of the middle third plus ``TOLERANCE_MB`` (the first third is warm-up: pools, caches and the
allocator's arenas fill there). Also: every request succeeds, and the nodes end at idle memory.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import wait_idle

SAMPLE_S = 1.0
TOLERANCE_MB = 8.0


def group_rss_mb(leader: int) -> dict[int, float]:
    """pid -> RSS (MiB) of every live process in the process group led by ``leader``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != leader:  # pgrp
                continue
            with open(f"/proc/{entry}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            out[int(entry)] = rss / 1024.0
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return out


@dataclass
class SoakReport:
    seconds: float
    requests: Counter
    rss: dict[str, list[float]]  # "name/pid" -> samples (MiB)
    not_idle: list[str]

    def verdicts(self) -> dict[str, tuple[float, float, float, bool]]:
        """name -> (first-third max, middle-third max, last-third max, flat)."""
        out = {}
        for name, xs in self.rss.items():
            k = len(xs) // 3
            if k < 1:
                continue
            a, b, c = max(xs[:k]), max(xs[k:2 * k]), max(xs[2 * k:])
            out[name] = (a, b, c, c <= b + TOLERANCE_MB)
        return out

    @property
    def clean(self) -> bool:
        v = self.verdicts()
        return bool(v) and all(flat for *_, flat in v.values()) and set(self.requests) == {"ok"} \
            and not self.not_idle

    def table(self) -> str:
        lines = [f"soak: {self.seconds:g} s, requests {dict(self.requests)}",
                 f"{'process':<28}{'1st third':>10}{'2nd third':>10}{'3rd third':>10}  max RSS MiB"]
        for name, (a, b, c, flat) in self.verdicts().items():
            lines.append(f"{name:<28}{a:>10.1f}{b:>10.1f}{c:>10.1f}  {'flat' if flat else 'GROWS'}")
        lines += [f"  not idle: {n}" for n in self.not_idle]
        lines.append("CLEAN" if self.clean else "NOT CLEAN")
        return "\n".join(lines)


async def _load(url: str, seconds: float, concurrency: int, vocab: int, counts: Counter) -> None:
    rng = random.Random(0)
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def worker() -> None:
            while time.monotonic() < deadline:
                body = {"input_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(16, 128))], "stream": True,
                        "sampling_params": {"max_new_tokens": rng.randrange(8, 48), "temperature": 0, "ignore_eos": True}}
                try:
                    async with session.post(url + "/generate", json=body) as r:
                        raw = await r.read()
                    counts["ok" if r.status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                           else f"HTTP {r.status}"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    counts[type(exc).__name__] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _sample(cluster: LocalCluster, seconds: float, rss: dict[str, list[float]]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, proc in cluster.procs.items():
            for pid, mb in group_rss_mb(proc.pid).items():
                rss.setdefault(f"{name}/{pid}", []).append(mb)
        await asyncio.sleep(SAMPLE_S)


def run_soak(model_dir: str, logdir: str, seconds: float, concurrency: int = 32) -> SoakReport:
    import json

    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    cluster = LocalCluster(logdir=logdir)
    counts: Counter = Counter()
    rss: dict[str, list[float]] = {}
    try:
        url = cluster.start(model_dir, backend="mooncake", num_prefill=1, num_decode=1, router="ours",
                            startup_timeout_s=180)
        assert url is not None

        async def both() -> None:
            await asyncio.gather(_load(url, seconds, concurrency, vocab, counts), _sample(cluster, seconds, rss))

        asyncio.run(both())
        not_idle = []
        for node in cluster.nodes:
            try:
                wait_idle(node.url, timeout_s=30)
            except AssertionError as exc:
                not_idle.append(str(exc)[:300])
    except BaseException:
        print(cluster.log_tails(40))
        raise
    finally:
        cluster.stop()
    # Short-lived helpers (a resource tracker that came late) have too few samples to judge.
    rss = {k: v for k, v in rss.items() if len(v) >= 6}
    return SoakReport(seconds=seconds, requests=counts, rss=rss, not_idle=not_idle)
