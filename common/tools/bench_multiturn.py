"""``pdcluster bench --workload multiturn``: N conversations x T turns, each turn resending the
whole conversation, as chat and agent clients do::

    turn 1 prompt   random ids, length from --input-len / --range-ratio
    turn k prompt   turn k-1's prompt + its answer (the ids the decode generated) + new user ids
                    (--turn-len / --range-ratio)
    output          --output-len / --range-ratio per turn (ignore_eos: exact)

Turns run in rounds: every conversation sends turn k at once (under --max-concurrency, if any),
then, once all have answered, the nodes' counters are read and each conversation "thinks"
(exponential, mean --think-time s) before its next turn. A round boundary is what makes each
turn's counters its own (the decodes' ``pdc_decode_transferred_*`` / ``pdc_decode_reused_tokens``
and the prefills' cached / computed prompt tokens are node totals). A conversation whose turn
failed sends no more turns. Reported per turn: TTFT (p50, mean), KV bytes and tokens that crossed
the wire to the decodes, the decodes' prefix-hit rate (reused / prompt tokens that arrived or were
reused) and the prefills' (cached / cached + computed).

The draw (prompts, lengths, think times) comes from one ``random.Random(seed)``; the prompts of
turns >= 2 also depend on the answers, which greedy decoding makes reproducible.
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from common.tools import bench_report as report
from common.tools.bench_client import RequestResult, Target, send
from common.tools.bench_workload import BenchRequest, length_bounds

# Node counters read after every round: (role prefix of the node name, metric name).
DECODE_METRICS = ("pdc_decode_transferred_tokens_total", "pdc_decode_reused_tokens_total",
                  "pdc_decode_transferred_bytes_total")
PREFILL_METRICS = ("pdc_scheduler_cached_tokens_total", "pdc_scheduler_prompt_tokens_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)$")


@dataclass(frozen=True)
class Conversation:
    index: int
    first_prompt: list[int]
    user_turns: list[list[int]]  # new user ids appended before turns 2..T
    output_lens: list[int]  # per turn
    think_s: list[float]  # pause after each turn but the last


def make_conversations(num: int, turns: int, input_len: int, turn_len: int, output_len: int, range_ratio: float,
                       vocab_size: int, think_time_s: float, seed: int) -> list[Conversation]:
    if num < 1 or turns < 1:
        raise ValueError(f"--num-conversations {num} and --num-turns {turns} must be >= 1")
    if think_time_s < 0:
        raise ValueError(f"--think-time {think_time_s} must be >= 0")
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    turn_lo, turn_hi = length_bounds(turn_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    return [Conversation(
        index=c,
        first_prompt=ids(rng.randint(in_lo, in_hi)),
        user_turns=[ids(rng.randint(turn_lo, turn_hi)) for _ in range(turns - 1)],
        output_lens=[rng.randint(out_lo, out_hi) for _ in range(turns)],
        think_s=[rng.expovariate(1 / think_time_s) if think_time_s > 0 else 0.0 for _ in range(turns - 1)],
    ) for c in range(num)]


def longest_prompt(input_len: int, turn_len: int, output_len: int, turns: int) -> int:
    """The longest last-turn prompt the draw allows (for the context-length check)."""
    return input_len + (turns - 1) * (output_len + turn_len)


def node_counters(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(1) in names:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def turn_row(turn: int, results: list[RequestResult], before: dict[str, float], after: dict[str, float]) -> dict:
    """One turn's line of the report from its results and the summed node counters around it."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (*DECODE_METRICS, *PREFILL_METRICS)}
    ok = [r for r in results if r.ok]
    ttft = report.distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]) or {}
    sent, reused = d["pdc_decode_transferred_tokens_total"], d["pdc_decode_reused_tokens_total"]
    cached, computed = d["pdc_scheduler_cached_tokens_total"], d["pdc_scheduler_prompt_tokens_total"]
    return {
        "turn": turn, "requests": len(results), "ok": len(ok),
        "mean_prompt_tokens": round(sum(r.input_len for r in results) / max(len(results), 1), 1),
        "ttft_p50_ms": ttft.get("p50"), "ttft_mean_ms": ttft.get("mean"),
        "transferred_tokens": int(sent), "reused_tokens": int(reused),
        "transferred_bytes": int(d["pdc_decode_transferred_bytes_total"]),
        "transferred_bytes_per_request": round(d["pdc_decode_transferred_bytes_total"] / max(len(ok), 1)),
        "decode_hit_rate": round(reused / (sent + reused), 4) if sent + reused else None,
        "prefill_hit_rate": round(cached / (cached + computed), 4) if cached + computed else None,
    }


def read_nodes(nodes: dict[str, str], get_text: Callable[[str], str]) -> dict[str, float]:
    """The round counters summed over the nodes (decode ones from decodes, the rest from prefills);
    a node that does not answer counts nothing (its turn then shows less)."""
    total: dict[str, float] = {}
    for name, url in nodes.items():
        names = DECODE_METRICS if name.startswith("decode") else PREFILL_METRICS
        try:
            got = node_counters(get_text(url + "/metrics"), names)
        except (OSError, ValueError):
            continue
        for k, v in got.items():
            total[k] = total.get(k, 0.0) + v
    return total


def format_turns(rows: list[dict]) -> str:
    lines = ["| turn | ok/sent | mean prompt | TTFT p50 (ms) | KV bytes/request to decode | decode hit | prefill hit |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    for r in rows:
        ttft = "-" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:.1f}"
        lines.append(f"| {r['turn']} | {r['ok']}/{r['requests']} | {r['mean_prompt_tokens']:g} | {ttft} | "
                     f"{r['transferred_bytes_per_request']:,} | {pct(r['decode_hit_rate'])} | {pct(r['prefill_hit_rate'])} |")
    return "\n".join(lines)


async def run_conversations(target: Target, convs: list[Conversation], read_counters: Callable[[], dict[str, float]],
                            max_concurrency: int | None, request_timeout_s: float, deadline_s: float
                            ) -> tuple[list[RequestResult], float, list[dict]]:
    """Every conversation turn by turn, in rounds (module docstring). Returns every request's
    result (turn-major), the duration, and one report row per turn. ``read_counters()`` sums
    the nodes' counters (blocking HTTP: run in a thread)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    prompts = {c.index: list(c.first_prompt) for c in convs}
    alive = {c.index for c in convs}
    results: list[RequestResult] = []
    rows: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    index = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await send(session, target, req, t0, request_timeout_s, keep_output=True)
            async with sem:
                return await send(session, target, req, t0, request_timeout_s, keep_output=True)

        turns = max(len(c.output_lens) for c in convs)
        for turn in range(turns):
            left = deadline_s - (time.perf_counter() - t0)
            active = [c for c in convs if c.index in alive]
            if not active or left <= 0:
                break
            reqs = []
            for c in active:
                reqs.append(BenchRequest(index, list(prompts[c.index]), c.output_lens[turn], 0.0))
                index += 1
            before = await asyncio.to_thread(read_counters)
            tasks = [asyncio.create_task(one(r)) for r in reqs]
            done, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            after = await asyncio.to_thread(read_counters)
            round_results = []
            for c, req, task in zip(active, reqs, tasks):
                if task.cancelled() or task.exception() is not None:
                    res = RequestResult(req.index, req.input_len, req.output_len, error="not finished before the run's --timeout"
                                        if task.cancelled() else f"bench error: {task.exception()!r}")
                else:
                    res = task.result()
                round_results.append(res)
                if not res.ok:
                    alive.discard(c.index)
                elif turn + 1 < len(c.output_lens):
                    prompts[c.index] = prompts[c.index] + res.output_ids + c.user_turns[turn]
            results.extend(round_results)
            rows.append(turn_row(turn + 1, round_results, before, after))
            if turn + 1 < turns:
                # Each conversation thinks on its own clock; the round waits for the slowest thinker.
                await asyncio.sleep(max((c.think_s[turn] for c in active if c.index in alive and turn < len(c.think_s)),
                                        default=0.0))
        duration = time.perf_counter() - t0
    return results, duration, rows
