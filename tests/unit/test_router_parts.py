"""The router's parts without a network: flags, rooms, the prefix tree, policies, request parsing."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest

from router.config import CacheAwareConfig, ConfigError, WorkerSpec, parse_config
from router.parse import RouterError, bootstrap_fields, inspect
from router.policies import CacheAware, LeastLoaded, PowerOfTwo, RoundRobin, make_policy
from router.prefix_tree import PrefixTree
from router.rooms import MAX_ROOM, Rooms
from router.workers import Worker, Workers

# ---- flags -----------------------------------------------------------------------------------------


def test_flags_in_sglang_router_shapes() -> None:
    cfg = parse_config(["--host", "0.0.0.0", "--port", "9000", "--prefill", "http://p0:30000", "8998",
                        "--prefill", "http://p1:30000/", "--decode", "http://d0:30001", "--policy", "power-of-two",
                        "--prefill-policy", "cache-aware", "--pd-disaggregation", "--insecure"])
    assert cfg.workers == (WorkerSpec("http://p0:30000", "prefill", 8998), WorkerSpec("http://p1:30000", "prefill", None),
                           WorkerSpec("http://d0:30001", "decode"))
    assert (cfg.prefill_policy, cfg.decode_policy, cfg.port) == ("cache-aware", "power-of-two", 9000)
    assert cfg.decode_local_prefill_tokens == 0  # off unless asked for
    assert parse_config(["--decode-local-prefill-tokens", "128"]).decode_local_prefill_tokens == 128


def test_a_router_open_to_the_network_needs_a_key_or_insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDC_API_KEY", raising=False)
    monkeypatch.delenv("PDC_OPERATOR_KEY", raising=False)
    with pytest.raises(ConfigError, match="no key"):
        parse_config(["--host", "0.0.0.0", "--decode", "http://d0:30001"])
    assert parse_config(["--host", "127.0.0.1", "--decode", "http://d0:30001"]).api_key is None  # loopback: fine
    key = "client-key-0123456789abcdef"
    assert parse_config(["--host", "0.0.0.0", "--api-key", key]).api_key == key
    with pytest.raises(ConfigError, match="must differ"):
        parse_config(["--api-key", key, "--operator-key", key])


@pytest.mark.parametrize("argv, what", [
    (["--prefill", "p0:30000"], "not an http"),
    (["--prefill", "http://p0:30000", "70000"], "not in 1..65535"),
    (["--prefill", "http://p0:30000", "x"], "not a number"),
    (["--prefill", "http://p0:1", "1", "2"], "at most one bootstrap port"),
    (["--decode", "http://d:1/v1"], "base URL"),
    (["--decode", "http://d:1", "--decode", "http://d:1"], "listed twice"),
    (["--request-timeout-s", "0"], "--request-timeout-s must be > 0"),
    (["--cache-threshold", "1.5"], "--cache-threshold"),
    (["--max-retries", "-1"], "--max-retries"),
    (["--decode-local-prefill-tokens", "-1"], "--decode-local-prefill-tokens"),
])
def test_bad_flag_values_name_the_flag(argv: list[str], what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        parse_config(argv)


def test_cli_exit_status_and_message_for_bad_values() -> None:
    out = subprocess.run([sys.executable, "-m", "router", "--prefill", "ftp://x"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "pdcluster router: --prefill" in out.stderr


def test_router_process_imports_no_torch_transformers_or_numpy() -> None:
    code = ("import sys, router.__main__, router.app, router.forward;"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- rooms -----------------------------------------------------------------------------------------


def test_rooms_are_in_range_unique_while_in_flight_and_released_once(monkeypatch: pytest.MonkeyPatch) -> None:
    rooms = Rooms()
    # 5; then for a span of 2: 5..6 and 4..5 both hold the busy 5, 6..7 is free
    draws = iter([5, 5, 4, 6])
    monkeypatch.setattr("router.rooms.secrets.randbelow", lambda n: next(draws))
    assert rooms.reserve() == 5
    assert rooms.reserve(2) == 6
    assert len(rooms) == 3
    with pytest.raises(RuntimeError):
        rooms.release(100)
    rooms.release(5)
    with pytest.raises(RuntimeError):
        rooms.release(5)  # exactly once


def test_room_spans_stay_inside_the_63_bit_range(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    draws = iter([None, 0])  # None: the largest base randbelow may return

    def randbelow(n: int) -> int:
        seen.append(n)
        d = next(draws)
        return n - 1 if d is None else d

    monkeypatch.setattr("router.rooms.secrets.randbelow", randbelow)
    rooms = Rooms()
    base = rooms.reserve(4)
    assert base + 3 == MAX_ROOM and seen == [MAX_ROOM - 4 + 2]
    with rooms.hold(2) as b:
        assert b == 0 and len(rooms) == 6
    assert len(rooms) == 4


# ---- prefix tree -----------------------------------------------------------------------------------


def test_prefix_tree_matches_per_worker_and_splits_edges() -> None:
    t = PrefixTree(10_000)
    t.insert("You are a helpful assistant. Q1", "w0")
    t.insert("You are a helpful bot. Q2", "w1")
    m = t.match("You are a helpful assistant. Q9")
    assert m == {"w0": len("You are a helpful assistant. Q"), "w1": len("You are a helpful ")}
    assert t.match("Something else") == {}
    assert t.chars == len("You are a helpful ") + len("assistant. Q1") + len("bot. Q2")


def test_prefix_tree_stays_under_its_bound_evicting_least_recent() -> None:
    t = PrefixTree(1000)
    rng = random.Random(0)
    prompts = [f"{i:04d}" + "".join(rng.choice("abc") for _ in range(40)) for i in range(300)]
    for i, p in enumerate(prompts):
        t.insert(p, f"w{i % 3}")
        assert t.chars <= 1000
    assert max(t.match(prompts[-1]).values()) == len(prompts[-1])  # the newest survive whole
    assert max(t.match(prompts[0]).values()) < 4  # the oldest went first: only "0" / "00" is shared


def test_prefix_tree_forgets_a_worker() -> None:
    t = PrefixTree(10_000)
    t.insert("shared prefix A", "w0")
    t.insert("shared prefix B", "w1")
    t.remove_worker("w0")
    assert t.match("shared prefix A") == {"w1": len("shared prefix ")}


# ---- policies --------------------------------------------------------------------------------------


def _w(url: str, inflight: int = 0, polled: int = 0, at_poll: int = 0) -> Worker:
    return Worker(url, "prefill", healthy=True, inflight=inflight, polled_reqs=polled, inflight_at_poll=at_poll)


def test_load_is_own_inflight_plus_what_the_node_reports_beyond_it() -> None:
    assert _w("a", inflight=3, polled=10, at_poll=2).load == 3 + 8
    assert _w("a", inflight=3, polled=1, at_poll=2).load == 3  # the node has not seen ours yet


def test_least_loaded_picks_the_minimum_and_breaks_ties_at_random() -> None:
    ws = [_w("a", 2), _w("b", 0), _w("c", 0), _w("d", 5)]
    policy = LeastLoaded(random.Random(1))
    picks = Counter(policy.pick(ws, None).url for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 50


def test_power_of_two_never_picks_the_worse_of_its_pair() -> None:
    ws = [_w("a", 0), _w("b", 9)]
    assert {PowerOfTwo(random.Random(2)).pick(ws, None).url for _ in range(50)} == {"a"}
    three = [_w("a", 0), _w("b", 1), _w("c", 9)]
    assert "c" not in {PowerOfTwo(random.Random(3)).pick(three, None).url for _ in range(200)}


def test_round_robin_cycles_in_a_stable_order() -> None:
    rr, ws = RoundRobin(), [_w("b"), _w("a"), _w("c")]
    assert [rr.pick(ws, None).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_cache_aware_sends_a_shared_prefix_to_its_owner_within_the_load_bound() -> None:
    p = CacheAware(CacheAwareConfig(threshold=0.5, balance_abs_threshold=4, max_tree_chars=100_000), random.Random(0))
    a, b = _w("a"), _w("b")
    system = "You are a helpful assistant who answers in one line. "
    first = p.pick([a, b], system + "Q0")
    p.on_routed(first, system + "Q0")
    other = b if first is a else a
    for i in range(1, 6):
        first.inflight = 3  # busier, but within the bound: the cache wins
        assert p.pick([a, b], system + f"Q{i}") is first
    first.inflight = 10  # beyond the bound: the least loaded wins
    assert p.pick([a, b], system + "Q9") is other
    first.inflight = 0
    assert p.pick([a, b], "an unrelated prompt of some length") in (a, b)
    p.forget(first.url)
    assert p.pick([a, other], system + "Q1") is not None


def test_make_policy_knows_every_name() -> None:
    from router.config import POLICIES

    for name in POLICIES:
        assert make_policy(name, CacheAwareConfig()) is not None
    with pytest.raises(ValueError):
        make_policy("fastest", CacheAwareConfig())


# ---- workers ---------------------------------------------------------------------------------------


def test_workers_leave_on_failures_and_drain_on_removal() -> None:
    forgotten: list[str] = []
    ws = Workers((WorkerSpec("http://p:1", "prefill", 8998), WorkerSpec("http://d:1", "decode")), 2, forgotten.append)
    p, d = ws.get("http://p:1"), ws.get("http://d:1")
    assert p is not None and d is not None and ws.candidates("prefill") == []  # unknown until probed
    ws.probed(p, True)
    ws.probed(d, True)
    assert ws.candidates("prefill") == [p]
    ws.probed(p, False, "boom")
    assert p.healthy  # one failure is below the threshold
    ws.probed(p, False, "boom")
    assert not p.healthy and ws.candidates("prefill") == []
    ws.probed(p, True)
    assert p.healthy
    with pytest.raises(ValueError):
        ws.add(WorkerSpec("http://p:1", "prefill"))
    with ws.busy(p, d):
        ws.remove("http://p:1")
        assert p.draining and ws.candidates("prefill") == [] and ws.get("http://p:1") is p
    assert ws.get("http://p:1") is None and forgotten == ["http://p:1"]
    ws.mark_failed(d, "connection refused")
    assert not d.healthy and ws.candidates("decode") == []


def test_stopped_workers_loops_return_after_the_probe_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() ends run() without cancelling a probe mid-connect (which can leave a TLS socket
    open): the probe in flight finishes and is counted, and no new one starts."""
    import asyncio

    import router.workers as rw

    started: list[str] = []
    finished: list[str] = []

    async def slow_probe(session: object, url: str, secret: object, timeout_s: float) -> str:
        started.append(url)
        await asyncio.sleep(0.2)
        finished.append(url)
        return "down"

    monkeypatch.setattr(rw, "challenge_probe", slow_probe)

    async def main() -> Workers:
        ws = Workers((WorkerSpec("http://d:1", "decode"),), 2, lambda url: None)
        task = asyncio.create_task(ws.run(None, 0.01, 60.0, 1.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the first probe is in flight
        ws.stop()
        await asyncio.wait_for(task, 2.0)  # returns by itself
        return ws

    ws = asyncio.run(main())
    d = ws.get("http://d:1")
    assert started == finished == ["http://d:1"] and d is not None and d.failures == 1


def test_a_hung_worker_does_not_hold_back_another_ones_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped node's probe hangs for the whole timeout; a node back from a restart must rejoin
    within a probe period of answering, not after the hung probe's timeout."""
    import asyncio

    import router.workers as rw

    up_at = 0.1  # the restarted node answers from here on
    hang_s = 2.0  # the stopped node's probe: a timeout's worth

    async def probe(session: object, url: str, secret: object, timeout_s: float) -> str | None:
        if url == "http://hung:1":
            await asyncio.sleep(hang_s)
            return "timeout"
        return None if asyncio.get_running_loop().time() - t0 >= up_at else "connection refused"

    monkeypatch.setattr(rw, "challenge_probe", probe)

    async def main() -> float:
        nonlocal t0
        ws = Workers((WorkerSpec("http://hung:1", "prefill"), WorkerSpec("http://back:1", "prefill")), 2,
                     lambda url: None)
        t0 = asyncio.get_running_loop().time()
        task = asyncio.create_task(ws.run(None, 0.05, 60.0, hang_s))  # type: ignore[arg-type]
        back = ws.get("http://back:1")
        assert back is not None
        while not back.healthy and asyncio.get_running_loop().time() - t0 < hang_s + 1:
            await asyncio.sleep(0.01)
        rejoined = asyncio.get_running_loop().time() - t0
        ws.stop()
        await asyncio.wait_for(task, hang_s + 1)
        return rejoined

    t0 = 0.0
    rejoined = asyncio.run(main())
    assert up_at <= rejoined < up_at + 0.5, rejoined  # a period or two after it answers, not hang_s


def test_a_hung_worker_does_not_hold_back_another_ones_load_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load polls are per worker too: while one worker's ``/get_load`` hangs, another's figure keeps
    its period (each poll answers how many polls it has seen, so the figure counts them)."""
    import asyncio
    import contextlib

    import router.workers as rw

    hang_s = 2.0
    polls = {"http://hung:1": 0, "http://busy:1": 0}

    async def probe(session: object, url: str, secret: object, timeout_s: float) -> None:
        return None

    class Response:
        status = 200

        def __init__(self, n: int) -> None:
            self.n = n

        async def json(self, content_type: object = None) -> list[dict]:
            return [{"num_reqs": self.n}]

    class Session:
        @contextlib.asynccontextmanager
        async def get(self, url: str, timeout: object = None):  # type: ignore[no-untyped-def]
            worker = url.removesuffix("/get_load")
            polls[worker] += 1
            if worker == "http://hung:1":
                await asyncio.sleep(hang_s)
            yield Response(polls[worker])

    monkeypatch.setattr(rw, "challenge_probe", probe)

    async def main() -> Workers:
        ws = Workers((WorkerSpec("http://hung:1", "decode"), WorkerSpec("http://busy:1", "decode")), 2,
                     lambda url: None)
        for w in ws.all():
            ws.probed(w, True)
        task = asyncio.create_task(ws.run(Session(), 60.0, 0.05, hang_s))  # type: ignore[arg-type]
        await asyncio.sleep(0.5)
        ws.stop()
        await asyncio.wait_for(task, hang_s + 1)
        return ws

    ws = asyncio.run(main())
    busy = ws.get("http://busy:1")
    assert busy is not None and busy.polled_reqs >= 5, busy  # ~10 periods of 0.05 s in 0.5 s, not 1
    assert polls["http://hung:1"] == 1  # one poll at a time per worker


# ---- parsing ---------------------------------------------------------------------------------------


def test_inspect_counts_sequences_and_finds_the_prompt_key() -> None:
    assert inspect("generate", {"text": "hi", "stream": True}).__dict__ == {
        "stream": True, "sequences": 1, "items": None, "key": "hi"}
    i = inspect("generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}})
    assert (i.sequences, i.items, i.key) == (4, 2, "1,2,")
    assert inspect("completions", {"prompt": ["a", "b", "c"]}).sequences == 3
    assert inspect("chat", {"messages": [{"role": "user", "content": "x"}], "n": 3}).sequences == 3
    assert inspect("generate", {"input_ids": [1, 2]}).key == "1,2,"


@pytest.mark.parametrize("endpoint, body, what", [
    ("generate", [], "JSON object"),
    ("generate", {}, "exactly one of"),
    ("generate", {"text": "a", "input_ids": [1]}, "exactly one of"),
    ("generate", {"input_ids": []}, "'input_ids' must be"),
    ("generate", {"text": "a", "stream": "yes"}, "'stream' must be"),
    ("generate", {"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("generate", {"text": "a", "sampling_params": [1]}, "'sampling_params' must be"),
    ("completions", {"max_tokens": 3}, "'prompt' is required"),
    ("completions", {"prompt": [1, "a"]}, "'prompt' must be"),
    ("chat", {"messages": []}, "'messages'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 10**6}, "at most"),
])
def test_inspect_refuses_what_it_can_judge(endpoint: str, body: object, what: str) -> None:
    with pytest.raises(RouterError, match=what) as exc:
        inspect(endpoint, body)
    assert exc.value.status == 400


def test_bootstrap_fields_give_a_batch_one_room_per_item() -> None:
    batch = inspect("generate", {"input_ids": [[1], [2], [3]]})
    assert bootstrap_fields(batch, "h", 7, 100) == {"bootstrap_host": ["h"] * 3, "bootstrap_port": [7] * 3,
                                                    "bootstrap_room": [100, 101, 102]}
    n2 = inspect("generate", {"input_ids": [[1], [2]], "sampling_params": {"n": 2}})
    assert bootstrap_fields(n2, "h", None, 100) == {"bootstrap_host": "h", "bootstrap_port": None,
                                                    "bootstrap_room": 100}
