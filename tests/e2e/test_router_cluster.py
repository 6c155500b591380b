"""Our router in front of 2 prefill + 2 decode nodes (real Mooncake over TCP, tiny qwen3), launched
the way ``pdcluster up`` launches them (common/tools/local_cluster.py). Every request goes to the
router's port; the nodes are only read for their counters and memory, and killed.

    test_openai_client_*      32 concurrent requests from the official ``openai`` client, chat and
                              completions, streamed and not: equal HF greedy; every node served some
    test_cache_aware_*        a second router (cache-aware) on the same nodes sends a shared-prefix
                              workload to one prefill, whose ``cached_tokens`` show the hits
    test_prefill_killed_*     SIGKILL of one prefill under load: every request is retried and equals
                              HF within the bound; the node leaves rotation and returns after a restart
    test_decode_killed_*      SIGKILL of a decode mid-stream: its streams end with an error event
                              within the bound; the other decode keeps serving
    test_workers_*            /workers DELETE and POST during a run: no request fails
    test_structured_*         response_format json_schema: the acceptance run over 20 schemas
                              (tests/e2e/grammar_schemas.py, GRAMMAR_REQUESTS; openai client, streamed
                              and not, greedy and sampled): every answer parses and validates; greedy
                              ones equal HF generate with the grammar as a logits processor; regex and EBNF on /generate; beta...parse with a pydantic
                              model; tool_choice required / named give valid arguments (tool_calls,
                              streamed and not); bad grammars and tool names are 400s that leave every
                              node idle

Every test ends with every live node back at idle memory (the leak check), and the tests run in
file order on one cluster: the kill tests restart what they killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import pytest

from common.tokenizer import Tokenizer
from common.cpu_budget import split_threads
from common.tools.bench_report import scheduler_counters
from common.tools.local_cluster import CODE_ROOT, LocalCluster, free_port
from tests.e2e.cluster import NEAR_TIE, check_greedy, check_greedy_text, wait_idle
from tests.e2e import grammar_schemas as grammar

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REQUEST_TIMEOUT_S = 45.0  # the router's per-request bound; clients must hear back within it
# Nodes notice a dead peer within about a second (heartbeats) and give up on a room in seconds.
NODE_ENV = {"PDC_HEARTBEAT_INTERVAL_S": "0.5", "PDC_HEARTBEAT_MAX_FAILURES": "2", "PDC_BOOTSTRAP_TIMEOUT_S": "10",
            "PDC_WAITING_TIMEOUT_S": "15", "PDC_HUNG_PEER_QUARANTINE_S": "2"}
ROUTER_ARGS = ["--health-check-interval-s", "0.5", "--health-failure-threshold", "2",
               "--request-timeout-s", str(REQUEST_TIMEOUT_S), "--max-retries", "3", "--retry-budget-s", "30"]
GEN = {"temperature": 0, "ignore_eos": True}


@dataclass
class Routed:
    cluster: LocalCluster
    url: str
    model: str  # served model name, from the router's /v1/models
    model_dir: str
    tok: Tokenizer
    _client: "openai.OpenAI | None" = field(default=None, repr=False)

    def client(self) -> "openai.OpenAI":
        """One client for the module (thread-safe), closed with the fixture: clients left to the
        garbage collector let their sockets be finalized first, a ResourceWarning (an error here)
        in whichever test happens to run then."""
        if self._client is None:
            self._client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                                         timeout=REQUEST_TIMEOUT_S + 15)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def generate(self, body: dict, url: str | None = None) -> httpx.Response:
        return httpx.post(f"{url or self.url}/generate", json=body, timeout=REQUEST_TIMEOUT_S + 15)

    def node_url(self, name: str) -> str:
        return next(n.url for n in self.cluster.nodes if n.name == name)

    def counters(self) -> dict[str, dict[str, float]]:
        return {n.name: scheduler_counters(httpx.get(n.url + "/metrics", timeout=10).text)
                for n in self.cluster.nodes if self.cluster.procs[n.name].poll() is None}

    def workers(self) -> dict[str, dict]:
        body = httpx.get(f"{self.url}/workers", timeout=10).json()
        return {w["url"]: w for w in body["workers"]}

    def wait_worker(self, name: str, healthy: bool, timeout_s: float = 20.0) -> None:
        url, deadline = self.node_url(name), time.monotonic() + timeout_s
        while self.workers().get(url, {}).get("healthy") is not healthy:
            assert time.monotonic() < deadline, f"{name} not healthy={healthy} in the router after {timeout_s:g} s"
            time.sleep(0.2)

    def wait_idle(self) -> None:
        for n in self.cluster.nodes:
            if self.cluster.procs[n.name].poll() is None:
                wait_idle(n.url)


@pytest.fixture(scope="module")
def routed(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    model_dir = tiny_model_factory("qwen3")
    cluster = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-router-e2e")), env=NODE_ENV)
    try:
        url = cluster.start(model_dir, backend="mooncake", num_prefill=2, num_decode=2, router="ours",
                            router_args=ROUTER_ARGS, startup_timeout_s=180)
        assert url is not None
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        routed = Routed(cluster, url, model, model_dir, Tokenizer(model_dir))
        try:
            yield routed
        finally:
            routed.close()
    except BaseException:
        print(cluster.log_tails(60))
        raise
    finally:
        cluster.stop()


# ---- one request through the openai client, checked against HF ------------------------------------


def openai_request(r: Routed, kind: str, stream: bool, i: int, n: int) -> tuple[str, list[int]]:
    """(answer text, the prompt's token ids as the node builds them)."""
    client = r.client()
    if kind == "chat":
        msgs = [{"role": "user", "content": f"question {i}: where do prefill and decode meet?"}]
        prompt = list(r.tok.apply_chat_template(msgs, add_generation_prompt=True))
        resp = client.chat.completions.create(model=r.model, messages=msgs, max_tokens=n, stream=stream,
                                              temperature=0, extra_body={"ignore_eos": True})
        text = ("".join(c.choices[0].delta.content or "" for c in resp if c.choices) if stream
                else resp.choices[0].message.content)
    else:
        text_in = f"prompt {i}: the router mints a room"
        prompt = r.tok.encode(text_in)
        resp = client.completions.create(model=r.model, prompt=text_in, max_tokens=n, stream=stream, temperature=0,
                                         extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in resp if c.choices) if stream else resp.choices[0].text
    return text or "", prompt


def test_openai_client_32_concurrent_match_hf_and_every_node_serves(routed: Routed) -> None:
    # The launcher divided this host's cores among the four nodes, in one core-share group; each
    # reports its budget, and its place on the group's board.
    groups = set()
    for n in routed.cluster.nodes:
        info = httpx.get(n.url + "/server_info", timeout=10).json()
        cpu = info["cpu"]
        assert cpu["threads"] == split_threads(4) and cpu["bind"] is None and cpu["share"], (n.name, cpu)
        groups.add(cpu["share"])
        # A tiny model's forward is too short to split (ModelRunner.splits_well): its decode does not borrow.
        assert info["cpu_share"]["borrow"] is False and info["cpu_share"]["base_threads"] == cpu["threads"]
        # What start-up made is out of the cyclic collector's walk (a full collection stalls the loop).
        assert info["gc_frozen_objects"] > 10_000, (n.name, info["gc_frozen_objects"])
    assert len(groups) == 1
    before = routed.counters()
    jobs = [(kind, stream, i) for i in range(8) for kind in ("chat", "completion") for stream in (False, True)]
    n = 6
    with ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(lambda j: openai_request(routed, j[0], j[1], j[2], n), jobs))
    for (kind, stream, i), (text, prompt) in zip(jobs, results):
        check_greedy_text(routed.model_dir, routed.tok.decode, prompt, text, n, f"{kind} stream={stream} #{i}")
    after = routed.counters()
    served = {name: after[name].get(key, 0) - before[name].get(key, 0)
              for name, key in (("prefill0", "prompt_tokens_total"), ("prefill1", "prompt_tokens_total"),
                                ("decode0", "generated_tokens_total"), ("decode1", "generated_tokens_total"))}
    assert all(v > 0 for v in served.values()), f"a node served nothing: {served}"
    assert served["decode0"] + served["decode1"] == len(jobs) * n
    routed.wait_idle()


def test_cache_aware_sends_a_shared_prefix_to_one_prefill(routed: Routed) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache-aware",
            "--log-level", "warning"]
    for n in routed.cluster.prefills:
        argv += ["--prefill", n.url, str(n.bootstrap_port)]
    for n in routed.cluster.decodes:
        argv += ["--decode", n.url]
    proc = subprocess.Popen(argv, cwd=CODE_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ws = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(ws) == 4 and all(w["healthy"] for w in ws):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "cache-aware router did not come up"
            time.sleep(0.2)
        prefix = "A shared system prompt that every request of this tenant starts with, long enough " * 3
        before = routed.counters()
        cached = []
        for i in range(6):
            text = f"{prefix} question number {i}?"
            resp = routed.generate({"text": text, "sampling_params": {"max_new_tokens": 3, **GEN}}, url=url)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            cached.append(out["meta_info"]["cached_tokens"])
            if i == 0:
                check_greedy(routed.model_dir, routed.tok.encode(text), out["output_ids"], 3, "cache-aware first")
        after = routed.counters()
        got = {p.name: after[p.name]["prompt_tokens_total"] - before[p.name].get("prompt_tokens_total", 0)
               for p in routed.cluster.prefills}
        assert sorted(v > 0 for v in got.values()) == [False, True], f"prompts spread over prefills: {got}"
        assert cached[0] == 0 or cached[0] < len(routed.tok.encode(prefix)) // 2
        assert all(c >= 16 for c in cached[1:]), f"later requests should hit the shared prefix: {cached}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    routed.wait_idle()


# ---- faults -------------------------------------------------------------------------------------


def busy_prefill(r: Routed, timeout_s: float = 1.0) -> str:
    """A prefill node the router has a request in flight on right now (polled for up to
    ``timeout_s``; prefill0 if none shows one)."""
    prefills = [n for n in r.cluster.nodes if n.role == "prefill"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = r.workers()
        for n in prefills:
            if workers.get(n.url, {}).get("inflight", 0) > 0:
                return n.name
    return "prefill0"


def router_counter(r: Routed, name: str) -> float:
    """Sum of a router counter over its labels, from its /metrics."""
    text = httpx.get(r.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_prefill_killed_under_load_requests_retry_and_succeed(routed: Routed) -> None:
    # Requests start every 40 ms over ~1.3 s; the kill lands in the middle, so some are on the
    # killed node (its connections reset) and some pick it before the router has noticed.
    prompts = [[(7 * i + 13 * k) % 800 + 5 for k in range(60 + 10 * (i % 4))] for i in range(32)]
    n = 24
    retries_before = router_counter(routed, "pdc_router_retries_total")

    def one(i: int, p: list[int]) -> tuple[httpx.Response, float]:
        time.sleep(0.04 * i)
        t0 = time.monotonic()
        resp = routed.generate({"input_ids": p, "sampling_params": {"max_new_tokens": n, **GEN}})
        return resp, time.monotonic() - t0

    with ThreadPoolExecutor(len(prompts)) as ex:
        futures = [ex.submit(one, i, p) for i, p in enumerate(prompts)]
        time.sleep(0.5)
        # The prefill the router has a request on now: on a fast machine a request is in flight for
        # a few milliseconds, and a fixed victim may have none when it dies (and none picked after).
        victim = busy_prefill(routed)
        routed.cluster.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    for i, ((resp, elapsed), p) in enumerate(zip(results, prompts)):
        assert resp.status_code == 200, (i, resp.status_code, resp.text)
        assert elapsed < REQUEST_TIMEOUT_S, f"request {i} waited {elapsed:.1f} s, past the router's bound"
        check_greedy(routed.model_dir, p, resp.json()["output_ids"], n, f"request {i} after a prefill kill")
    assert router_counter(routed, "pdc_router_retries_total") > retries_before, "no request needed a retry"
    routed.wait_worker(victim, healthy=False)
    routed.wait_idle()  # the survivors hold nothing
    routed.cluster.restart(victim)
    routed.wait_worker(victim, healthy=True)
    before = routed.counters()[victim].get("prompt_tokens_total", 0)
    for i in range(12):  # least-loaded with random ties: the restarted node gets some of these
        resp = routed.generate({"input_ids": [3, 4, 5 + i], "sampling_params": {"max_new_tokens": 2, **GEN}})
        assert resp.status_code == 200, resp.text
    assert routed.counters()[victim]["prompt_tokens_total"] > before, "the restarted prefill got no request"
    routed.wait_idle()


def test_decode_killed_mid_stream_ends_its_streams_with_an_error(routed: Routed) -> None:
    n_streams, n = 8, 1500  # long enough to still be streaming when the kill lands

    def stream(i: int, first: threading.Event) -> tuple[list[dict], float]:
        """(events, when the stream ended)."""
        body = {"input_ids": [11 + i, 12, 13], "sampling_params": {"max_new_tokens": n, **GEN}, "stream": True}
        events: list[dict] = []
        with httpx.stream("POST", routed.url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S + 15) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                    first.set()
        return events, time.monotonic()

    firsts = [threading.Event() for _ in range(n_streams)]
    with ThreadPoolExecutor(n_streams) as ex:
        futures = [ex.submit(stream, i, firsts[i]) for i in range(n_streams)]
        for e in firsts:
            assert e.wait(30), "a stream never started"
        killed_at = time.monotonic()
        routed.cluster.kill("decode0", signal.SIGKILL)
        results = [f.result() for f in futures]
    assert all(ev[-1] == {"done": True} for ev, _ in results), "every stream ends with [DONE]"
    errored = [(ev, end) for ev, end in results if "error" in ev[-2]]
    finished = [ev for ev, _ in results if "error" not in ev[-2]]
    assert errored, "no stream was on the killed decode"
    for ev, end in errored:  # an error event, within seconds, not a hang until the request timeout
        assert end - killed_at < 10, f"the error came {end - killed_at:.1f} s after the kill"
        assert not any("error" in e for e in ev[:-2])
    for ev in finished:  # the other decode's streams complete
        assert len(ev[-2]["output_ids"]) == n
    # the other decode keeps serving, through the router
    routed.wait_worker("decode0", healthy=False)
    for i in range(4):
        resp = routed.generate({"input_ids": [21, 22, 23 + i], "sampling_params": {"max_new_tokens": 3, **GEN}})
        assert resp.status_code == 200, resp.text
        check_greedy(routed.model_dir, [21, 22, 23 + i], resp.json()["output_ids"], 3, "after a decode kill")
    routed.wait_idle()
    routed.cluster.restart("decode0")
    routed.wait_worker("decode0", healthy=True)


def test_workers_removed_and_added_during_a_run_fail_no_request(routed: Routed) -> None:
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            p = [30 + k, 31, 32 + i % 50]
            resp = routed.generate({"input_ids": p, "sampling_params": {"max_new_tokens": 4, **GEN}})
            if resp.status_code != 200:
                failures.append(f"{resp.status_code} {resp.text[:200]}")
            else:
                done[0] += 1
            i += 1

    by_name = {n.name: n for n in routed.cluster.nodes}
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(client, k) for k in range(4)]
        try:
            for name in ("prefill1", "decode1"):
                node = by_name[name]
                time.sleep(1.0)
                resp = httpx.delete(f"{routed.url}/workers", params={"url": node.url}, timeout=10)
                assert resp.status_code == 200, resp.text
                # One snapshot: a drained worker may leave the list between two reads.
                listed = routed.workers()
                assert node.url not in listed or listed[node.url].get("draining")
                time.sleep(1.0)
                body = {"url": node.url, "role": node.role, "bootstrap_port": node.bootstrap_port}
                resp = httpx.post(f"{routed.url}/workers", json=body, timeout=10)
                assert resp.status_code == 200, resp.text
                routed.wait_worker(name, healthy=True)
            time.sleep(1.0)
        finally:
            stop.set()
            for f in futures:
                f.result()
    assert not failures, failures[:5]
    assert done[0] > 8
    assert len(routed.workers()) == 4 and all(w["healthy"] for w in routed.workers().values())
    routed.wait_idle()


# ---- structured outputs (after the fault tests, whose kill windows are timing-sensitive) -------------


def check_constrained(r: Routed, prompt: list[int], got: list[int] | str, kind: str, spec: str, n: int, what: str) -> None:
    """Greedy output under a grammar (token ids, or an OpenAI answer's text) equals HF generate with
    that grammar as a logits processor (tests/reference.py: llguidance's matcher used directly,
    none of our grammar code); after a near-tie step only what came before it must match."""
    from tests.reference import hf_greedy_constrained

    want, gaps = hf_greedy_constrained(r.model_dir, prompt, n, kind, spec)
    tie = next((k for k, g in enumerate(gaps[: len(want)]) if g < NEAR_TIE), len(want))
    if isinstance(got, str):  # text: re-encoding it need not give the ids the model chose
        assert got.startswith(r.tok.decode(want[:tie])), f"{what}: got {got!r}, HF {r.tok.decode(want)!r}"
        assert tie < len(want) or got == r.tok.decode(want), f"{what}: got {got!r}, HF {r.tok.decode(want)!r}"
    else:
        assert got[:tie] == want[:tie] and (tie < len(want) or got == want), f"{what}: got {got}, HF {want}"


def structured_chat(r: Routed, job: grammar.Job) -> tuple[str, str | None]:
    """(answer text, finish_reason) of one acceptance request through the openai client."""
    resp = r.client().chat.completions.create(stream=job.stream, **job.body(r.model))
    if not job.stream:
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    chunks = list(resp)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next((c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason), None)


def test_structured_outputs_validate_and_greedy_match_hf(routed: Routed) -> None:
    """The acceptance run (tests/e2e/grammar_schemas.py) on 2P2D: GRAMMAR_REQUESTS requests,
    60 by default (3 per schema, a greedy one among them)."""
    jobs = grammar.plan(grammar.requests_from_env(60))
    t0 = time.monotonic()
    results = grammar.run(jobs, lambda j: structured_chat(routed, j))
    print(f"2P2D: {len(jobs)} structured requests in {time.monotonic() - t0:.1f} s")
    grammar.check(jobs, results, routed.model_dir, routed.tok, NEAR_TIE)
    routed.wait_idle()


def test_structured_regex_and_ebnf_on_generate_match_hf(routed: Routed) -> None:
    cases = [("regex", "(cache|node|room)-[0-9]{2,4}"), ("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]')]
    for kind, spec in cases:
        for stream in (False, True):
            prompt = routed.tok.encode(f"answer with {kind}")
            body = {"input_ids": prompt, "stream": stream, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                              kind: spec}}
            with httpx.stream("POST", f"{routed.url}/generate", json=body, timeout=REQUEST_TIMEOUT_S + 15) as resp:
                assert resp.status_code == 200, resp.read()
                raw = resp.read().decode()
            events = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")] if stream else [json.loads(raw)]
            final = events[-1]
            assert final["meta_info"]["finish_reason"]["type"] == "stop", final
            check_constrained(routed, prompt, final["output_ids"], kind, spec, 40, f"{kind} stream={stream}")
    routed.wait_idle()


def test_structured_openai_parse_with_a_pydantic_model(routed: Routed) -> None:
    from enum import Enum

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Item(BaseModel):
        color: Color
        count: int = Field(ge=0, le=9)

    class Order(BaseModel):
        id: int = Field(ge=1, le=999)
        items: list[Item] = Field(max_length=3)
        rush: bool

    out = routed.client().beta.chat.completions.parse(
        model=routed.model, messages=[{"role": "user", "content": "an order"}], response_format=Order, max_tokens=200,
        temperature=0)
    order = out.choices[0].message.parsed
    assert isinstance(order, Order) and 1 <= order.id <= 999 and len(order.items) <= 3, out
    assert out.choices[0].finish_reason == "stop"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]


def streamed_tool_calls(r: Routed, **body: Any) -> tuple[Any, list[str]]:
    """A streamed chat request through the openai client's own stream helper: (the completion it
    assembles from the deltas, the argument fragments it received)."""
    fragments = []
    with r.client().chat.completions.stream(model=r.model, **body) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        return stream.get_final_completion(), fragments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_structured_tool_choice_returns_valid_arguments(routed: Routed, choice: Any) -> None:
    """Valid arguments, streamed and not; the streamed calls (name first, then argument fragments,
    as OpenAI streams them) assemble in the openai client to the non-streamed ones."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    body = {"messages": [{"role": "user", "content": "what is the weather in Oslo?"}], "tools": TOOLS,
            "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    whole = routed.client().chat.completions.create(model=routed.model, **body)  # type: ignore[arg-type]
    streamed, fragments = streamed_tool_calls(routed, **body)
    for resp in (whole, streamed):
        msg = resp.choices[0].message
        calls, finish, content = msg.tool_calls or [], resp.choices[0].finish_reason, msg.content or ""
        assert finish == "tool_calls" and len(calls) == 1 and content == "", (finish, calls, content)
        name = calls[0].function.name
        assert name in params and (choice == "required" or name == choice["function"]["name"])
        jsonschema.validate(json.loads(calls[0].function.arguments), params[name])
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    # How many fragments depends on how the stream coalesces tokens (timing); they add up to the call.
    assert "".join(fragments) == (whole.choices[0].message.tool_calls or [])[0].function.arguments
    routed.wait_idle()


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
     "Unimplemented keys"),
    ({"regex": "[0-9"}, "invalid regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "not one of the tools"),
])
def test_structured_bad_grammars_are_400s_that_allocate_nothing(routed: Routed, body: dict, needle: str) -> None:
    full = {"model": routed.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **body}
    resp = httpx.post(f"{routed.url}/v1/chat/completions", json=full, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 400 and needle in resp.text, resp.text
    routed.wait_idle()
