"""A seeded chaos run: our router in front of 2 prefill + 2 decode nodes (real Mooncake over TCP,
a tiny model), N requests with a random mix of client-side faults, and node faults on a
schedule. ``make chaos`` runs 1000 requests; tests/e2e/test_chaos.py a CI-sized run.

Request faults (each request draws one, seeded):

    none            plain request, streamed or not: must equal HF greedy token for token
    client_abort    a whole-answer request the client gives up on after a random delay
    disconnect      a stream the client closes after a random number of events
    abort_request   a stream, then ``POST /abort_request {"rid"}`` at the router after its first event
    slow_reader     a stream the client stops reading for a while (then reads to the end)

A third of the requests without ``abort_request`` go to the OpenAI API (``/v1/completions`` with a
token-id prompt) instead of ``/generate``: their text must equal what HF's greedy tokens add to the
prompt's text (``text_matches``).

Node faults, spread over the run: SIGKILL + restart of a prefill, SIGKILL + restart of a decode,
SIGSTOP of a prefill for longer than the heartbeat bound + quarantine, then SIGCONT.

At the end: every live node back at its idle memory, every completed request equal to HF greedy
(near-tie rule of tests/e2e/cluster.py), every other one ended with a clear error (an HTTP
error with a message, an SSE error event, or finish_reason abort) within the bound, and every
node's scheduler serving again (``/health_generate``).
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import httpx

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import NEAR_TIE, wait_idle

# Small bounds so the storm is quick; the node faults are timed against them.
NODE_ENV = {"PDC_HEARTBEAT_INTERVAL_S": "0.5", "PDC_HEARTBEAT_MAX_FAILURES": "2", "PDC_BOOTSTRAP_TIMEOUT_S": "10",
            "PDC_WAITING_TIMEOUT_S": "15", "PDC_HUNG_PEER_QUARANTINE_S": "2"}
HEARTBEAT_BOUND_S = 0.5 * (2 + 1)
QUARANTINE_S = 5.0  # the quarantine is raised to the Mooncake write timeout's 5 s floor
REQUEST_BOUND_S = 45.0  # the router's per-request timeout: every request must end within it
# A worker back from a fault is in rotation after one good probe: within a probe period plus a
# probe's timeout (the router's defaults: 2 s) of answering again. Four such rounds is the bound.
READMIT_BOUND_S = 4 * (0.5 + 2.0)
ROUTER_ARGS = ["--health-check-interval-s", "0.5", "--health-failure-threshold", "2",
               "--request-timeout-s", str(REQUEST_BOUND_S), "--max-retries", "3", "--retry-budget-s", "30"]
FAULTS = {"none": 0.6, "client_abort": 0.1, "disconnect": 0.1, "abort_request": 0.1, "slow_reader": 0.1}
NODE_FAULTS = ("kill_prefill", "kill_decode", "stop_prefill")
NUM_PROMPTS = 24  # distinct prompts (HF references are computed once each)


@dataclass
class Outcome:
    index: int
    fault: str
    stream: bool
    kind: str = ""  # completed | clear_error | client_gone | unclear
    detail: str = ""
    elapsed_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    prompt: int = 0
    openai: bool = False  # /v1/completions: judged on ``text``, not ``tokens``
    text: str = ""


@dataclass
class Report:
    requests: int
    seed: int
    outcomes: Counter
    by_fault: dict[str, Counter]
    node_faults: list[str]
    wrong_tokens: list[str]
    unclear: list[str]
    not_idle: list[str]
    wedged: list[str]
    max_error_s: float
    max_elapsed_s: float
    wall_s: float
    openai_completed: int = 0  # completed requests that went through /v1/completions
    readmit_s: float = 0.0  # from every node answering /health_generate to the router having them all in rotation
    logs: str = ""  # the processes' log tails, kept when a node was not idle or something wedged

    @property
    def clean(self) -> bool:
        return not (self.wrong_tokens or self.unclear or self.not_idle or self.wedged) \
            and self.max_elapsed_s <= REQUEST_BOUND_S + 5.0

    def table(self) -> str:
        lines = [f"chaos run: {self.requests} requests, seed {self.seed}, wall {self.wall_s:.1f} s",
                 f"node faults: {', '.join(self.node_faults)}",
                 f"{'fault':<15}{'completed':>10}{'clear err':>10}{'client gone':>12}{'unclear':>9}"]
        for fault, c in sorted(self.by_fault.items()):
            lines.append(f"{fault:<15}{c['completed']:>10}{c['clear_error']:>10}{c['client_gone']:>12}{c['unclear']:>9}")
        lines += [f"completed {self.outcomes['completed']} ({self.openai_completed} over the OpenAI API), "
                  f"wrong tokens {len(self.wrong_tokens)}",
                  f"clear errors {self.outcomes['clear_error']} (slowest {self.max_error_s:.1f} s, bound {REQUEST_BOUND_S:g} s)",
                  f"unclear endings {len(self.unclear)}, slowest request {self.max_elapsed_s:.1f} s",
                  f"nodes not back at idle: {len(self.not_idle)}, wedged: {len(self.wedged)}, "
                  f"router had every node in rotation {self.readmit_s:.1f} s after they answered",
                  "CLEAN" if self.clean else "NOT CLEAN"]
        lines += [f"  wrong: {w}" for w in self.wrong_tokens[:10]] + [f"  unclear: {u}" for u in self.unclear[:10]]
        lines += [f"  not idle: {n}" for n in self.not_idle] + [f"  wedged: {w}" for w in self.wedged]
        if self.logs:
            lines.append(self.logs)
        return "\n".join(lines)


def prompts(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(8, 60))], rng.randrange(6, 48))
            for _ in range(NUM_PROMPTS)]


def references(model_dir: str, pool: list[tuple[list[int], int]]) -> list[tuple[list[int], list[float]]]:
    from tests.reference import hf_greedy

    return [hf_greedy(model_dir, p, n) for p, n in pool]


def matches(got: list[int], want: list[int], gaps: list[float]) -> bool:
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return gaps[step] < NEAR_TIE  # a near-tie may go either way; the rest then differs
    return got == want


def text_matches(got: str, prompt: list[int], want: list[int], gaps: list[float], decode) -> bool:  # type: ignore[no-untyped-def]
    """OpenAI answers are text: what HF's tokens add to the prompt's text, up to the first near-tie step.

    What they add, not ``decode(want)`` alone: random ids include lone bytes of multi-byte
    characters, and a prompt ending in one and an answer starting with another decode to a single
    U+FFFD together (two apart). The API's text is the completion's part of ``decode(prompt +
    answer)``, as vLLM's and SGLang's detokenizers make it (they start from the prompt's last ids)."""
    head = decode(prompt)

    def added(ids: list[int]) -> str:
        return decode(prompt + ids)[len(head):]

    tie = next((k for k, g in enumerate(gaps) if g < NEAR_TIE), None)
    # Cut at a tie, the last id may end mid-character: its U+FFFD is not a promise about the text.
    return got == added(want) if tie is None else got.startswith(added(want[:tie]).rstrip("\ufffd"))


async def one(session: aiohttp.ClientSession, url: str, i: int, fault: str, stream: bool, openai: bool,
              pool: list[tuple[list[int], int]], rng: random.Random) -> Outcome:
    pi = rng.randrange(len(pool))
    prompt, n = pool[pi]
    rid = f"chaos-{i}"
    if openai:
        path = "/v1/completions"
        body: dict = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    else:
        path = "/generate"
        body = {"rid": rid, "input_ids": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    out = Outcome(i, fault, stream, prompt=pi, openai=openai)
    t0 = time.monotonic()
    try:
        if fault == "client_abort":
            try:
                async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                    async with session.post(url + path, json={**body, "stream": False}) as r:
                        status, raw = r.status, await r.read()
                return _judge_whole(out, status, raw)  # answered before the client gave up
            except TimeoutError:
                out.kind = "client_gone"
                return out
        if not stream:
            async with session.post(url + path, json=body) as r:
                raw = await r.read()
                return _judge_whole(out, r.status, raw)
        return await _stream(session, url, path, out, body, fault, rng)
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind, out.detail = "unclear", f"connection error: {type(exc).__name__}: {exc}"
        return out
    finally:
        out.elapsed_s = time.monotonic() - t0


def _judge_whole(out: Outcome, status: int, raw: bytes) -> Outcome:
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if status == 200 and isinstance(doc, dict) and out.openai:
        choice = (doc.get("choices") or [{}])[0]
        if choice.get("finish_reason") in ("length", "stop"):
            out.kind, out.text = "completed", str(choice.get("text", ""))
        else:
            out.kind, out.detail = "clear_error", f"finish_reason {choice.get('finish_reason')!r}"
        return out
    if status == 200 and isinstance(doc, dict):
        finish = doc.get("meta_info", {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            out.kind, out.detail = "clear_error", f"finish abort: {finish.get('message')}"
        else:
            out.kind, out.tokens = "completed", list(doc.get("output_ids") or [])
        return out
    message = doc.get("error", {}).get("message") if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else None
    if status >= 400 and message:
        out.kind, out.detail = "clear_error", f"HTTP {status}: {message[:120]}"
    else:
        out.kind, out.detail = "unclear", f"HTTP {status}: {raw[:200]!r}"
    return out


async def _stream(session: aiohttp.ClientSession, url: str, path: str, out: Outcome, body: dict, fault: str,
                  rng: random.Random) -> Outcome:
    close_after = rng.randrange(1, 6) if fault == "disconnect" else None
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            return _judge_whole(out, r.status, await r.read())
        buf, events, last = bytearray(), 0, None
        async for chunk in r.content.iter_any():
            buf += chunk
            while (end := buf.find(b"\n\n")) >= 0:
                frame, buf = bytes(buf[:end]), buf[end + 2:]
                if not frame.startswith(b"data: "):
                    continue
                data = frame[6:]
                if data == b"[DONE]":
                    return _judge_stream_end(out, last)
                event = json.loads(data)
                if "error" in event:
                    out.kind, out.detail = "clear_error", f"SSE error: {str(event['error'])[:120]}"
                    continue
                last, events = event, events + 1
                if out.openai:
                    out.text += "".join(c.get("text", "") for c in event.get("choices") or [])
                if close_after is not None and events >= close_after:
                    out.kind = "client_gone"
                    return out  # leaving the block closes the connection mid-stream
                if fault == "abort_request" and events == 1:
                    async with session.post(url + "/abort_request", json={"rid": body["rid"]}) as a:
                        await a.read()
                if fault == "slow_reader" and events == 1:
                    await asyncio.sleep(rng.uniform(1.0, 3.0))  # the stream queues up behind us
    out.kind, out.detail = (out.kind, out.detail) if out.kind == "clear_error" else ("unclear", "stream closed without [DONE]")
    return out


def _judge_stream_end(out: Outcome, last: dict | None) -> Outcome:
    if out.kind == "clear_error":
        return out
    if out.openai:
        reasons = [c.get("finish_reason") for c in (last or {}).get("choices") or []]
        # with include_usage off the last event is the one that carries the finish reason
        if reasons and reasons[-1] in ("length", "stop"):
            out.kind = "completed"
        else:
            out.kind, out.detail = "clear_error", f"stream finish_reason {reasons[-1:]!r}"
        return out
    finish = ((last or {}).get("meta_info") or {}).get("finish_reason") or {}
    if finish.get("type") == "abort":
        out.kind, out.detail = "clear_error", f"finish abort: {finish.get('message')}"
    elif last is not None and finish:
        out.kind, out.tokens = "completed", list(last.get("output_ids") or [])
    else:
        out.kind, out.detail = "unclear", "stream ended without a finish reason"
    return out


def _inflight(router: str, node: str, cluster: LocalCluster) -> int:
    """Requests the router has on ``node`` right now (what a fault there hits)."""
    url = next(n.url for n in cluster.nodes if n.name == node)
    workers = httpx.get(router + "/workers", timeout=5).json()["workers"]
    return sum(int(w.get("inflight", 0)) for w in workers if w.get("url") == url)


async def _node_faults(cluster: LocalCluster, router: str, progress: asyncio.Queue, total: int,
                       log: list[str]) -> None:
    """A node fault when 20 %, 45 % and 70 % of the answers are in, each in a task of its own (a
    restart takes seconds: the storm goes on meanwhile, and the next fault does not wait)."""
    marks = {int(total * 0.2): "kill_prefill", int(total * 0.45): "kill_decode", int(total * 0.7): "stop_prefill"}
    tasks = []
    done = 0
    while done < total:
        await progress.get()
        done += 1
        if done in marks:
            tasks.append(asyncio.create_task(_one_fault(cluster, router, marks[done], log)))
    await asyncio.gather(*tasks)


async def _one_fault(cluster: LocalCluster, router: str, fault: str, log: list[str]) -> None:
    loop = asyncio.get_running_loop()
    t = time.monotonic()
    target = {"kill_prefill": "prefill1", "kill_decode": "decode1", "stop_prefill": "prefill0"}[fault]
    # Strike while the target has requests in flight (a fault on an idle node proves little), but
    # only wait so long: a quiet node is faulted anyway and the log says it hit nothing.
    deadline = time.monotonic() + 5.0
    while (hit := await loop.run_in_executor(None, _inflight, router, target, cluster)) == 0 \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if fault == "stop_prefill":
        cluster.kill(target, signal.SIGSTOP)
        await asyncio.sleep(HEARTBEAT_BOUND_S + QUARANTINE_S + 1.0)
        cluster.kill(target, signal.SIGCONT)
    else:
        await loop.run_in_executor(None, cluster.kill, target, signal.SIGKILL)
        await asyncio.sleep(1.0)
        await loop.run_in_executor(None, cluster.restart, target)
    log.append(f"{fault} with {hit} in flight there ({time.monotonic() - t:.1f} s)")


async def storm(cluster: LocalCluster, url: str, n: int, concurrency: int, seed: int,
                pool: list[tuple[list[int], int]]) -> tuple[list[Outcome], list[str]]:
    rng = random.Random(seed)
    plan = [(rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0], rng.random() < 0.5) for _ in range(n)]
    plan = [(f, True if f in ("disconnect", "abort_request", "slow_reader") else s) for f, s in plan]
    # /abort_request names a rid, which only /generate bodies carry: those stay native.
    openai = [f != "abort_request" and rng.random() < 1 / 3 for f, _ in plan]
    sem = asyncio.Semaphore(concurrency)
    progress: asyncio.Queue = asyncio.Queue()
    node_log: list[str] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_BOUND_S + 30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def run(i: int, fault: str, stream: bool) -> Outcome:
            async with sem:
                o = await one(session, url, i, fault, stream, openai[i], pool, random.Random(seed * 100003 + i))
            progress.put_nowait(i)
            return o

        faults = asyncio.create_task(_node_faults(cluster, url, progress, n, node_log))
        outcomes = await asyncio.gather(*(run(i, f, s) for i, (f, s) in enumerate(plan)))
        await faults
    return list(outcomes), node_log


def _wait_router_healthy(url: str, bound_s: float) -> tuple[float, list[dict]]:
    """Seconds until the router has every worker in rotation, and the ones still out at ``bound_s``."""
    t0 = time.monotonic()
    while True:
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        out = [{k: w.get(k) for k in ("url", "role", "healthy", "last_error")} for w in workers if not w["healthy"]]
        if not out or time.monotonic() - t0 > bound_s:
            return time.monotonic() - t0, out
        time.sleep(0.1)


def run_chaos(model_dir: str, logdir: str, n: int, concurrency: int = 8, seed: int = 0) -> Report:
    with open(f"{model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    pool = prompts(seed, vocab)
    refs = references(model_dir, pool)
    cluster = LocalCluster(logdir=logdir, env=NODE_ENV)
    t0 = time.monotonic()
    try:
        url = cluster.start(model_dir, backend="mooncake", num_prefill=2, num_decode=2, router="ours",
                            router_args=ROUTER_ARGS, startup_timeout_s=180)
        assert url is not None
        outcomes, node_log = asyncio.run(storm(cluster, url, n, concurrency, seed, pool))
        wall = time.monotonic() - t0
        not_idle, wedged = [], []
        for node in cluster.nodes:
            try:
                wait_idle(node.url, timeout_s=30)
            except AssertionError as exc:
                not_idle.append(str(exc)[:300])
            r = httpx.get(node.url + "/health_generate", timeout=30)
            if r.status_code != 200:
                wedged.append(f"{node.name}: /health_generate {r.status_code} {r.text[:200]}")
        # A node back from a fault rejoins the router's rotation at its next good probe, not at
        # once: wait for that (bounded by a few probe rounds) before judging the router by a request.
        readmit_s, waiting = _wait_router_healthy(url, READMIT_BOUND_S)
        if waiting:
            wedged.append(f"router: nodes still out of rotation {READMIT_BOUND_S:g} s after they answered: {waiting}")
        fresh = httpx.post(url + "/generate", timeout=60, json={"input_ids": pool[0][0], "sampling_params": {
            "max_new_tokens": pool[0][1], "temperature": 0, "ignore_eos": True}})
        if fresh.status_code != 200 or not matches(fresh.json()["output_ids"], *refs[0]):
            wedged.append(f"router: a fresh request after the storm got {fresh.status_code} {fresh.text[:200]}")
        # What CI prints must be enough to tell why: the processes' own last lines, before they stop.
        logs = cluster.log_tails(40) if wedged or not_idle else ""
    except BaseException:
        print(cluster.log_tails(40))
        raise
    finally:
        cluster.stop()
    from common.tokenizer import Tokenizer

    decode = Tokenizer(model_dir).decode
    wrong = [f"request {o.index} (prompt {o.prompt}, {'stream' if o.stream else 'whole'}, "
             f"{'openai' if o.openai else 'native'}): got {o.text if o.openai else o.tokens}, HF {refs[o.prompt][0]}"
             for o in outcomes if o.kind == "completed"
             and not (text_matches(o.text, pool[o.prompt][0], *refs[o.prompt], decode) if o.openai else matches(o.tokens, *refs[o.prompt]))]
    by_fault: dict[str, Counter] = {}
    for o in outcomes:
        by_fault.setdefault(o.fault, Counter())[o.kind] += 1
    errors = [o.elapsed_s for o in outcomes if o.kind == "clear_error"]
    return Report(requests=n, seed=seed, outcomes=Counter(o.kind for o in outcomes), by_fault=by_fault,
                  node_faults=node_log, wrong_tokens=wrong,
                  unclear=[f"request {o.index} ({o.fault}): {o.detail}" for o in outcomes if o.kind == "unclear"],
                  not_idle=not_idle, wedged=wedged, max_error_s=max(errors, default=0.0),
                  max_elapsed_s=max((o.elapsed_s for o in outcomes), default=0.0), wall_s=wall,
                  openai_completed=sum(o.openai and o.kind == "completed" for o in outcomes), readmit_s=readmit_s,
                  logs=logs)
