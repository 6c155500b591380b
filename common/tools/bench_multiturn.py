"""``pdcluster bench --workload multiturn``: N conversations x T turns, each turn resending the
whole conversation, as chat and agent clients do::

    turn 1 prompt   random ids, length from --input-len / --range-ratio
    turn k prompt   turn k-1's prompt + its answer (the ids the decode generated) + new user ids
                    (--turn-len / --range-ratio)
    output          --output-len / --range-ratio per turn (ignore_eos: exact)

Each conversation runs on its own clock, as users do: it starts at its arrival (a Poisson process
at --request-rate conversations per second; inf: all at once), sends a turn, waits for the whole
answer, "thinks" (exponential, mean --think-time s) and sends the next, under --max-concurrency
if any. A conversation whose turn failed sends no more turns.

What each turn reused is read from its own answer, not from node totals (so turns of different
conversations may overlap in time): ``cached_tokens`` (prompt tokens the prefill served from its
prefix cache) and ``decode_reused_tokens`` (prompt tokens the decode served from its own cache;
the rest of the prompt's KV crossed the wire), both in the native meta_info of every
disaggregated answer. Reported per turn: TTFT (p50, p99, mean), the tokens and KV bytes that
crossed the wire to the decode per request, the decodes' prefix-hit rate (reused / prompt) and the
prefills' (cached / prompt). Bytes are tokens x the run's KV bytes per token, from the decodes'
``pdc_decode_transferred_{bytes,tokens}_total`` read before and after the run; the run's
per-request token sum is checked against those node totals (``turn_summary``). A server that does
not report the fields (a peer engine) gets "-" for them.

The draw (arrivals, prompts, lengths, think times) comes from one ``random.Random(seed)``; the
prompts of turns >= 2 also depend on the answers, which greedy decoding makes reproducible.
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from common.tools import bench_report as report
from common.tools.bench_client import RequestResult, Target, send
from common.tools.bench_workload import BenchRequest, length_bounds

# The decodes' counters read before and after the run: bytes per token, and the check of the
# per-request token sum against the nodes' own.
DECODE_METRICS = ("pdc_decode_transferred_tokens_total", "pdc_decode_transferred_bytes_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)$")


@dataclass(frozen=True)
class Conversation:
    index: int
    start_s: float  # arrival, from the start of the run
    first_prompt: list[int]
    user_turns: list[list[int]]  # new user ids appended before turns 2..T
    output_lens: list[int]  # per turn
    think_s: list[float]  # pause after each turn but the last


def make_conversations(num: int, turns: int, input_len: int, turn_len: int, output_len: int, range_ratio: float,
                       vocab_size: int, think_time_s: float, seed: int, rate: float = math.inf) -> list[Conversation]:
    """``rate``: conversations per second, Poisson arrivals (inf: every conversation at 0)."""
    if num < 1 or turns < 1:
        raise ValueError(f"--num-conversations {num} and --num-turns {turns} must be >= 1")
    if think_time_s < 0:
        raise ValueError(f"--think-time {think_time_s} must be >= 0")
    if not rate > 0:
        raise ValueError(f"--request-rate {rate} must be > 0 (conversations per second)")
    rng = random.Random(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    turn_lo, turn_hi = length_bounds(turn_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    convs, t = [], 0.0
    for c in range(num):
        if c and math.isfinite(rate):
            t += rng.expovariate(rate)
        convs.append(Conversation(
            index=c, start_s=t,
            first_prompt=ids(rng.randint(in_lo, in_hi)),
            user_turns=[ids(rng.randint(turn_lo, turn_hi)) for _ in range(turns - 1)],
            output_lens=[rng.randint(out_lo, out_hi) for _ in range(turns)],
            think_s=[rng.expovariate(1 / think_time_s) if think_time_s > 0 else 0.0 for _ in range(turns - 1)],
        ))
    return convs


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


def read_nodes(nodes: dict[str, str], get_text: Callable[[str], str]) -> dict[str, float]:
    """The decodes' transfer counters summed over the decode nodes; a node that does not answer
    counts nothing (the run's check then shows the difference)."""
    total: dict[str, float] = {}
    for name, url in nodes.items():
        if not name.startswith("decode"):
            continue
        try:
            got = node_counters(get_text(url + "/metrics"), DECODE_METRICS)
        except (OSError, ValueError):
            continue
        for k, v in got.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _sum_or_none(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def turn_row(turn: int, results: list[RequestResult], bytes_per_token: float | None) -> dict:
    """One turn's line of the report, from its requests' own answers."""
    ok = [r for r in results if r.ok]
    ttft = report.distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]) or {}
    with_decode = [r for r in ok if r.decode_reused_tokens is not None]
    # The prefill's hit: a local request's cached_tokens is its decode's (it never met a prefill).
    with_cache = [r for r in ok if r.cached_tokens is not None and r.decode_computed_tokens is None]
    reused = _sum_or_none([r.decode_reused_tokens for r in with_decode])
    # A local request's KV did not cross the wire at all: its decode computed what it did not reuse.
    sent = (sum(r.input_len - (r.decode_reused_tokens or 0) - (r.decode_computed_tokens or 0) for r in with_decode)
            if with_decode else None)
    local = sum(r.decode_computed_tokens is not None for r in ok)
    cached = _sum_or_none([r.cached_tokens for r in with_cache])
    decode_prompts = sum(r.input_len for r in with_decode)
    cache_prompts = sum(r.input_len for r in with_cache)
    per_req = sent / len(with_decode) if sent is not None else None
    return {
        "turn": turn, "requests": len(results), "ok": len(ok),
        "mean_prompt_tokens": round(sum(r.input_len for r in results) / max(len(results), 1), 1),
        "ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"), "ttft_mean_ms": ttft.get("mean"),
        "transferred_tokens": sent, "reused_tokens": reused, "cached_tokens": cached, "decode_local": local,
        "transferred_tokens_per_request": None if per_req is None else round(per_req, 1),
        "transferred_bytes_per_request": (None if per_req is None or bytes_per_token is None
                                          else round(per_req * bytes_per_token)),
        "decode_hit_rate": round(reused / decode_prompts, 4) if reused is not None and decode_prompts else None,
        "prefill_hit_rate": round(cached / cache_prompts, 4) if cached is not None and cache_prompts else None,
    }


def turn_summary(rows: list[dict], turns_of: list[tuple[int, RequestResult]], tokens: float, size: float) -> dict:
    """The run's lines beside the per-turn rows: TTFT over turns >= 2 (what exact routing and the
    decode's cache are for), and the per-request transferred tokens against the decodes' totals
    (``tokens``, ``size``: their run's deltas, ``transferred``)."""
    later = [r.ttft_s for t, r in turns_of if t >= 2 and r.ok and r.ttft_s is not None]
    ttft = report.distribution_ms(later) or {}
    per_request = _sum_or_none([r["transferred_tokens"] for r in rows])
    return {"later_turns_ttft_p50_ms": ttft.get("p50"), "later_turns_ttft_p99_ms": ttft.get("p99"),
            "later_turns_ttft_mean_ms": ttft.get("mean"),
            "transferred_tokens_per_request_sum": per_request,
            "transferred_tokens_nodes": int(tokens), "transferred_bytes_nodes": int(size)}


def transferred(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """The decodes' (tokens, bytes) that crossed the wire between two readings."""
    return tuple(after.get(k, 0.0) - before.get(k, 0.0) for k in DECODE_METRICS)  # type: ignore[return-value]


def format_turns(rows: list[dict], summary: dict | None = None) -> str:
    lines = ["| turn | ok/sent | mean prompt | TTFT p50 (ms) | TTFT p99 (ms) | tokens/request to decode | "
             "KV bytes/request to decode | decode hit | prefill hit | on decode alone |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['turn']} | {r['ok']}/{r['requests']} | {r['mean_prompt_tokens']:g} | "
                     f"{num(r['ttft_p50_ms'], '.1f')} | {num(r['ttft_p99_ms'], '.1f')} | "
                     f"{num(r['transferred_tokens_per_request'], 'g')} | {num(r['transferred_bytes_per_request'], ',')} | "
                     f"{pct(r['decode_hit_rate'])} | {pct(r['prefill_hit_rate'])} | {r.get('decode_local', 0)} |")
    if summary is not None:
        lines.append(f"turns >= 2: TTFT p50 {num(summary['later_turns_ttft_p50_ms'], '.1f')} ms, "
                     f"p99 {num(summary['later_turns_ttft_p99_ms'], '.1f')} ms; tokens to the decodes: "
                     f"{num(summary['transferred_tokens_per_request_sum'], 'd')} by the answers, "
                     f"{summary['transferred_tokens_nodes']} by the nodes' counters")
    return "\n".join(lines)


async def run_conversations(target: Target, convs: list[Conversation], read_counters: Callable[[], dict[str, float]],
                            max_concurrency: int | None, request_timeout_s: float, deadline_s: float
                            ) -> tuple[list[RequestResult], float, list[dict], dict]:
    """Every conversation on its own clock (module docstring). Returns every request's result (in
    the order they were sent), the duration, one report row per turn and the run's summary.
    ``read_counters()`` sums the decodes' counters (blocking HTTP: run in a thread)."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sent: list[tuple[int, RequestResult]] = []  # (turn, result), in send order
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    next_index = 0
    before = await asyncio.to_thread(read_counters)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await send(session, target, req, t0, request_timeout_s, keep_output=True)
            async with sem:
                return await send(session, target, req, t0, request_timeout_s, keep_output=True)

        async def converse(c: Conversation) -> None:
            nonlocal next_index
            await asyncio.sleep(max(0.0, c.start_s - (time.perf_counter() - t0)))
            prompt = list(c.first_prompt)
            for turn, out_len in enumerate(c.output_lens):
                req = BenchRequest(next_index, prompt, out_len, 0.0)
                next_index += 1
                slot = len(sent)
                sent.append((turn + 1, RequestResult(req.index, req.input_len, req.output_len,
                                                     error="not finished before the run's --timeout")))
                try:
                    res = await one(req)
                except Exception as exc:  # noqa: BLE001 - a bench bug: report it, keep the rest
                    res = RequestResult(req.index, req.input_len, req.output_len, error=f"bench error: {exc!r}")
                sent[slot] = (turn + 1, res)
                if not res.ok or turn + 1 == len(c.output_lens):
                    return
                prompt = prompt + res.output_ids + c.user_turns[turn]
                await asyncio.sleep(c.think_s[turn])

        tasks = [asyncio.create_task(converse(c)) for c in convs]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()  # its request in flight keeps the "not finished" result put in its slot
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
    tokens, size = transferred(before, await asyncio.to_thread(read_counters))
    per_token = size / tokens if tokens > 0 else None
    turns = max(len(c.output_lens) for c in convs)
    rows = [turn_row(t, [r for tt, r in sent if tt == t], per_token) for t in range(1, turns + 1)
            if any(tt == t for tt, _ in sent)]
    summary = turn_summary(rows, sent, tokens, size)
    summary["request_turns"] = [t for t, _ in sent]  # each result's turn, in the results' order
    return [r for _, r in sent], duration, rows, summary
