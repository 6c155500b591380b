"""Tensor-parallel nodes (``--tp-size``) behind our router: real Mooncake over TCP, a tiny qwen3
with 8 query / 4 KV heads, the ranks of each node agreeing on every step over gloo.

One cluster: prefill0 and prefill1 at TP 2, prefill2 at TP 1; decode0 at TP 2, decode1 at TP 1.
One router of ours per combination, each in front of only its nodes:

    router-2to2   prefill0 -> decode0          equal TP, rank r to rank r
    router-2to1   prefill0 -> decode1          each decode head range from one of two prefill ranks
    router-1to2   prefill2 -> decode0          each decode rank's heads sliced out of one prefill rank
    router-2p1d   prefill0 + prefill1 -> decode1

    test_pairs_*               20 prompts through each router (half streamed): equal HF greedy;
                               every node idle at the end, rooms of every rank included
    test_json_schema_*         a json_schema request through a TP pair and an unequal one: the grammar
                               compiles on every rank, its readiness is agreed, the answer validates
    test_flush_cache_*         /flush_cache reaches every rank at the same step: a repeated prompt
                               hits the cache, is recomputed after the flush, and still equals HF
    test_decode_prefix_cache_* both decodes keep their prefix cache
                               (--disaggregation-decode-enable-radix-cache): a conversation's second
                               turn reuses the first turn's whole pages on every rank of decode0
                               (TP 2), from an equal (TP 2) and an unequal (TP 1) prefill, and on
                               decode1 (TP 1) from a TP 2 prefill; only the rest is sent, and both
                               turns equal HF
    test_decode_flush_*        /flush_cache on decode0 empties every rank's cache at the same step: the
                               same prompt again reuses nothing (a rank that kept its pages would
                               name another prefix to the TP 1 prefill, which refuses such a room)
    test_a_cached_page_*       garbage written through Mooncake into decode0's rank 1 pool only: the
                               next turn finds the change on that rank, every rank drops the branch
                               (the MIN over the ranks), nothing is reused, the answer equals HF
    test_client_abort_*        prefill1's rank 1 stops itself right before writing one room's KV
                               while its rank 0 writes the other half into decode1; the client
                               hangs up on the decode: the decode keeps the room's pages while
                               rank 1 could still write, rank 1 resumes and writes, and only then
                               are the pages back, once; the same pair then answers equal HF
    test_prefill_rank_killed_* prefill rank 1 stops itself right before writing one room's KV (fault
                               injection), then is SIGKILLed: the decode fails that room within the
                               dead-peer bound and gets every page back, though its rank 0 had
                               already received rank 0's half; the prefill's other rank exits too
    test_decode_rank_killed_*  SIGKILL of decode rank 1 while requests run on it behind router-retry
                               (prefill1 -> decode0, decode1): every request still answers equal HF
                               (the router retried those decode0 lost on decode1), the whole decode0
                               node (API and rank 0) is gone within seconds, no rank outlives it

The tests run in file order on one cluster; the kill tests come last.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.tokenizer import Tokenizer
from common.tools.local_cluster import LocalCluster, NodeInfo
from tests.e2e.cluster import check_greedy, is_idle, memory, metric, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FAULT_ROOM = 4_242_424_242  # a room our router never mints in this run (it draws from [0, 2^63))
# INFO: each decode rank logs its Mooncake session (test_a_cached_page_* writes into one of them).
NODE_ENV = {"PDC_HEARTBEAT_INTERVAL_S": "0.5", "PDC_HEARTBEAT_MAX_FAILURES": "2", "PDC_BOOTSTRAP_TIMEOUT_S": "10",
            "PDC_WAITING_TIMEOUT_S": "15", "PDC_FAULT_STOP_BEFORE_WRITE_ROOM": str(FAULT_ROOM), "PDC_FAULT_STOP_RANK": "1",
            "PDC_LOG_LEVEL": "INFO"}
DEAD_PEER_BOUND_S = 10.0  # heartbeats every 0.5 s, dead after 2 misses; generous for a loaded 2-core box
ROUTER_ARGS = ["--health-check-interval-s", "0.5", "--health-failure-threshold", "2", "--request-timeout-s", "45"]
GEN = {"temperature": 0, "ignore_eos": True}
N_NEW = 8


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


ROUTERS = {"router-2to2": ("prefill0", "decode0"), "router-2to1": ("prefill0", "decode1"),
           "router-1to2": ("prefill2", "decode0"), "router-2p1d": ("prefill0", "prefill1", "decode1")}
RETRY_ROUTER = ("prefill1", "decode0", "decode1")  # the decode-rank kill: decode1 takes decode0's requests


class TPCluster:
    def __init__(self, cluster: LocalCluster, routers: dict[str, str], model_dir: str) -> None:
        self.cluster, self.routers, self.model_dir = cluster, routers, model_dir
        self.url = routers["router-2to2"]
        self.tok = Tokenizer(model_dir)

    def node(self, name: str) -> NodeInfo:
        return next(n for n in self.cluster.nodes if n.name == name)

    def info(self, name: str) -> dict:
        return httpx.get(self.node(name).url + "/server_info", timeout=10).json()

    def generate(self, prompt: list[int], stream: bool, url: str | None = None, n_new: int = N_NEW) -> list[int]:
        url = url or self.url
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n_new, **GEN}, "stream": stream}
        if not stream:
            r = httpx.post(url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]
        ids: list[int] = []
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            import json

            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    ids = ev["output_ids"]  # cumulative, as SGLang streams /generate
        return ids

    def wait_idle(self) -> None:
        for n in self.cluster.nodes:
            if self.cluster.procs[n.name].poll() is None:
                wait_idle(n.url)


@pytest.fixture(scope="module")
def tp(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPCluster]:
    model_dir = tiny_model_factory("qwen3", num_attention_heads=8, num_key_value_heads=4)
    cluster = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-tp-e2e")), env=NODE_ENV)
    try:
        cluster.start(model_dir, backend="mooncake", num_prefill=3, num_decode=2, prefill_tp=(2, 2, 1),
                      decode_tp=(2, 1), decode_args=["--disaggregation-decode-enable-radix-cache"], router="none",
                      startup_timeout_s=180)
        routers = {name: cluster.start_router(name, nodes, ROUTER_ARGS)
                   for name, nodes in {**ROUTERS, "router-retry": RETRY_ROUTER}.items()}
        yield TPCluster(cluster, routers, model_dir)
    except BaseException:
        print(cluster.log_tails(60))
        raise
    finally:
        cluster.stop()


def test_every_node_runs_its_ranks(tp: TPCluster) -> None:
    for name, size in (("prefill0", 2), ("prefill1", 2), ("prefill2", 1), ("decode0", 2), ("decode1", 1)):
        info = tp.info(name)
        assert info["tp_size"] == size and len(set(info["scheduler_rank_pids"])) == size, (name, info)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_pairs_through_the_router_equal_hf(tp: TPCluster, router: str) -> None:
    prompts = [tp.tok.encode(f"{router} {i}: " + "tensor parallel ranks agree on every step " * (1 + i % 4))
               for i in range(20)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda ip: tp.generate(ip[1], ip[0] % 2 == 1, tp.routers[router]), enumerate(prompts)))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        check_greedy(tp.model_dir, prompt, out, N_NEW, f"{router} #{i} stream={i % 2 == 1}")
    tp.wait_idle()


SCHEMA = {"type": "object", "properties": {"rank": {"type": "integer", "minimum": 0, "maximum": 7},
                                          "role": {"enum": ["prefill", "decode"]}},
          "required": ["rank", "role"], "additionalProperties": False}


@pytest.mark.parametrize("router", ["router-2to2", "router-1to2"])
def test_json_schema_through_tp_nodes(tp: TPCluster, router: str) -> None:
    import json

    jsonschema = pytest.importorskip("jsonschema")
    body = {"text": "which rank?", "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                        "json_schema": json.dumps(SCHEMA)}}
    r = httpx.post(tp.routers[router] + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    tp.wait_idle()


def test_flush_cache_reaches_every_rank(tp: TPCluster) -> None:
    prompt = tp.tok.encode("a prompt long enough to fill two pages of sixteen tokens, sent three times " * 2)
    prefill = tp.node("prefill0").url

    def cached() -> int:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, **GEN}}
        r = httpx.post(tp.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        check_greedy(tp.model_dir, prompt, r.json()["output_ids"], N_NEW, "flush")
        return int(r.json()["meta_info"]["cached_tokens"])

    cached()
    assert cached() >= 16  # the second time the prefix comes from the cache, on both ranks
    tp.wait_idle()
    r = httpx.post(prefill + "/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    assert cached() == 0  # every rank dropped its cache at the same step: same pages, same answer
    tp.wait_idle()


@pytest.mark.parametrize("router", ["router-2to2", "router-1to2", "router-2to1"])
def test_decode_prefix_cache_reuses_the_first_turn_on_every_rank(tp: TPCluster, router: str) -> None:
    """Turn 2 = turn 1's prompt + its answer + new text. The decode keeps turn 1's whole pages and
    receives only the pages past them, from a prefill of its own TP size or another; the answers
    equal HF. Every rank reuses alike: from the TP 1 prefill, whose one rank serves both decode
    ranks, a room whose ranks named different prefixes would be refused (the answer reports rank
    0's reuse; a rank that diverged at equal TP is test_a_cached_page_*'s case)."""
    page, url = 16, tp.routers[router]
    decode = tp.node(ROUTERS[router][-1]).url

    def turn(prompt: list[int]) -> tuple[list[int], dict]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, **GEN}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]

    def counters() -> tuple[float, float]:
        return metric(decode, "pdc_decode_transferred_tokens_total"), metric(decode, "pdc_decode_reused_tokens_total")

    p1 = tp.tok.encode(f"{router}: the decode keeps this conversation's pages on each of its ranks " * 2)
    out1, meta1 = turn(p1)
    check_greedy(tp.model_dir, p1, out1, N_NEW, f"{router} turn 1")
    assert meta1["decode_reused_tokens"] == 0, meta1
    p2 = p1 + out1 + tp.tok.encode(" and the next turn sends only what is new")
    before = counters()
    out2, meta2 = turn(p2)
    check_greedy(tp.model_dir, p2, out2, N_NEW, f"{router} turn 2")
    # Turn 1 wrote KV for p1 + out1[:-1]: its whole pages; at least one token is left to receive.
    want = min((len(p1) + len(out1) - 1) // page * page, (len(p2) - 1) // page * page)
    assert want >= 2 * page and meta2["decode_reused_tokens"] == want, (want, meta2)
    after = counters()
    assert (after[0] - before[0], after[1] - before[1]) == (len(p2) - want, want)
    tp.wait_idle()


def test_decode_flush_cache_empties_every_rank(tp: TPCluster) -> None:
    url, decode = tp.routers["router-1to2"], tp.node("decode0").url
    prompt = tp.tok.encode("a prompt the decode caches, then forgets on both of its ranks " * 2)

    def reused() -> int:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, **GEN}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        check_greedy(tp.model_dir, prompt, r.json()["output_ids"], N_NEW, "decode flush")
        return int(r.json()["meta_info"]["decode_reused_tokens"])

    reused()
    assert reused() == (len(prompt) - 1) // 16 * 16  # the prompt's whole pages but the last token's
    tp.wait_idle()
    r = httpx.post(decode + "/flush_cache", timeout=10)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert memory(decode)["cached_pages"] == 0
    assert reused() == 0
    tp.wait_idle()


def _rank_session(tp: TPCluster, node: str, pid: int) -> str:
    """The Mooncake session of one rank of ``node``: the session a rank of it logged whose port
    that rank's process listens on."""
    import re

    from tests.e2e.test_prefix_cache_poisoning import listeners

    with open(os.path.join(tp.cluster.logdir or "", f"{node}.log"), errors="replace") as f:
        sessions = re.findall(r"decode KV manager up: status \S+, data (\S+)", f.read())
    ports = {port for p, _, port in listeners(tp.cluster.procs[node].pid) if p == pid}
    [session] = [s for s in set(sessions) if int(s.rsplit(":", 1)[1]) in ports]
    return session


def test_a_cached_page_changed_on_one_decode_rank_is_dropped_on_every_rank(tp: TPCluster) -> None:
    """Each rank of a TP decode checks its own heads' cached pages before reuse; the ranks agree
    on the first changed page (MIN), so a change one rank sees makes every rank drop the branch
    from there: they lock the same prefix, the prefill sends the rest, the answer equals HF."""
    import ctypes
    import json

    mooncake = pytest.importorskip("mooncake.engine")
    page, url, node = 16, tp.routers["router-2to2"], "decode0"
    decode = tp.node(node).url
    _, rank1 = tp.info(node)["scheduler_rank_pids"]
    p1 = tp.tok.encode("one rank of the decode finds this conversation's pages changed " * 2)
    body = {"input_ids": p1, "sampling_params": {"max_new_tokens": N_NEW, **GEN}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out1 = r.json()["output_ids"]
    check_greedy(tp.model_dir, p1, out1, N_NEW, "before the write")
    tp.wait_idle()
    # Garbage over every page (but the reserved page 0) of rank 1's first buffer: its share of
    # layer 0's K, 2 of the 4 KV heads. Rank 0's pool is untouched.
    with open(os.path.join(tp.model_dir, "config.json")) as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    nbytes = page * (hf["num_key_value_heads"] // 2) * head_dim * 4  # float32
    size = (memory(decode)["total_pages"] - 1) * nbytes
    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    garbage = ctypes.create_string_buffer(b"\x7f" * size, size)
    assert engine.register_memory(ctypes.addressof(garbage), size) == 0
    session = _rank_session(tp, node, rank1)
    target = engine.get_first_buffer_address(session)
    assert target, "the handshake named no buffer"
    assert engine.batch_transfer_sync_write(session, [ctypes.addressof(garbage)], [target + nbytes], [size]) == 0
    failures = metric(decode, "pdc_scheduler_kv_integrity_failures_total")
    p2 = p1 + out1 + tp.tok.encode(" and the next turn must not read them")
    r = httpx.post(url + "/generate", json={**body, "input_ids": p2}, timeout=60)
    assert r.status_code == 200, r.text
    check_greedy(tp.model_dir, p2, r.json()["output_ids"], N_NEW, "after the write on rank 1")
    # Without the agreement rank 0 would reuse turn 1's pages and report them, rank 1 none.
    assert r.json()["meta_info"]["decode_reused_tokens"] == 0, r.json()["meta_info"]
    assert metric(decode, "pdc_scheduler_kv_integrity_failures_total") == failures + 1  # rank 0 counts it too
    tp.wait_idle()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0]


def _hang_up_later(url: str, body: dict) -> socket.socket:
    """A streamed /generate sent on a raw socket, so the test hangs up exactly when it chooses
    (closing the socket is what a client that goes away does; the node sees http.disconnect)."""
    import json

    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_abort_while_two_prefill_ranks_write_frees_decode_pages_once(tp: TPCluster) -> None:
    prefill, decode = tp.node("prefill1"), tp.node("decode1")  # TP 2 -> TP 1: both ranks write into one pool
    _, rank1 = tp.info("prefill1")["scheduler_rank_pids"]
    prompt = tp.tok.encode("the client leaves while the second rank is about to write " * 3)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, **GEN}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": FAULT_ROOM}
    aborted = metric(decode.url, "pdc_scheduler_aborted_total")
    with ThreadPoolExecutor(1) as ex:
        p = ex.submit(httpx.post, prefill.url + "/generate", json={**body, "stream": True}, timeout=60)
        client = _hang_up_later(decode.url, body)
        try:
            deadline = time.monotonic() + 30
            while _state(rank1) != "T":  # rank 1 stopped before its write; rank 0 writes its half
                assert time.monotonic() < deadline, "prefill rank 1 never reached the room's write"
                time.sleep(0.05)
        finally:
            client.close()  # the client goes away
        try:
            deadline = time.monotonic() + 15
            while metric(decode.url, "pdc_scheduler_aborted_total") <= aborted:
                assert time.monotonic() < deadline, "the decode never aborted the room its client left"
                time.sleep(0.05)
            # Rank 1 can still write into the room's pages: the decode must keep them until it has
            # answered (or is proven gone), however long that takes.
            for _ in range(10):
                mem = memory(decode.url)
                assert not is_idle(mem), f"the decode freed the room's pages while a prefill rank could write: {mem}"
                time.sleep(0.1)
        finally:
            os.kill(rank1, signal.SIGCONT)  # it writes its half, then reads the AbortRoom and answers
        wait_idle(decode.url)
        wait_idle(prefill.url)
        # The prefill answers either way, bounded: Failed if rank 1 read the AbortRoom before its
        # write, else Success (its write landed in pages the decode still held, then it answered).
        p.result()
    prompts = [tp.tok.encode(f"after the abort {i}: " + "pages come back clean " * (1 + i)) for i in range(4)]
    for i, q in enumerate(prompts):  # the pages rank 1 wrote into are reused: every answer still equals HF
        check_greedy(tp.model_dir, q, tp.generate(q, i % 2 == 1, tp.routers["router-2p1d"]), N_NEW, f"after abort #{i}")
    tp.wait_idle()



def test_prefill_rank_killed_mid_transfer_fails_the_room_and_frees_decode_pages(tp: TPCluster) -> None:
    prefill, decode = tp.node("prefill0"), tp.node("decode0")
    rank0, rank1 = tp.info("prefill0")["scheduler_rank_pids"]
    prompt = tp.tok.encode("the room whose second half never arrives " * 3)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, **GEN}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": FAULT_ROOM}
    with ThreadPoolExecutor(2) as ex:
        p = ex.submit(httpx.post, prefill.url + "/generate", json={**body, "stream": True}, timeout=60)
        d = ex.submit(httpx.post, decode.url + "/generate", json=body, timeout=60)
        deadline = time.monotonic() + 30
        while _state(rank1) != "T":  # rank 1 stopped itself before writing its half
            assert time.monotonic() < deadline, "prefill rank 1 never reached the room's write"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        answer = d.result()
        failed_after = time.monotonic() - t0
        p.result()  # the prefill's own answer: an error, whenever its API notices; only bounded here
    assert answer.status_code == 503, answer.text
    assert failed_after < DEAD_PEER_BOUND_S, f"the decode took {failed_after:.1f} s to fail the room"
    wait_idle(decode.url)  # every page, row and aux slot back, on both decode ranks
    deadline = time.monotonic() + 20
    while _pid_alive(rank0):  # its next collective failed when rank 1's sockets closed
        assert time.monotonic() < deadline, "prefill rank 0 outlived rank 1 by 20 s"
        time.sleep(0.2)
    assert httpx.get(prefill.url + "/health", timeout=10).status_code == 503


def test_decode_rank_killed_takes_the_node_down_and_the_router_retries_elsewhere(tp: TPCluster) -> None:
    decode0 = tp.node("decode0")
    info = tp.info("decode0")
    api_pid = tp.cluster.procs["decode0"].pid
    rank0, rank1 = info["scheduler_rank_pids"]
    url, n_new = tp.routers["router-retry"], 32
    prompts = [tp.tok.encode(f"retry {i}: a decode rank dies under this request " * (1 + i % 3)) for i in range(16)]
    generated = metric(decode0.url, "pdc_scheduler_generated_tokens_total")
    with ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(tp.generate, q, False, url, n_new) for q in prompts]
        deadline = time.monotonic() + 30
        while metric(decode0.url, "pdc_scheduler_generated_tokens_total") <= generated:  # requests run on decode0
            assert time.monotonic() < deadline, "no request reached decode0"
            time.sleep(0.02)
        os.kill(rank1, signal.SIGKILL)
        outs = [f.result() for f in futs]  # generate() asserts 200: none of them failed
    for i, (q, out) in enumerate(zip(prompts, outs)):
        check_greedy(tp.model_dir, q, out, n_new, f"retry #{i}")
    assert metric(url, "pdc_router_retries_total") >= 1  # some ran on decode0 when it died, and were tried again
    deadline = time.monotonic() + 20
    while any(_pid_alive(p) for p in (api_pid, rank0)):
        assert time.monotonic() < deadline, "the decode node outlived its killed rank by 20 s"
        time.sleep(0.2)
    more = [tp.tok.encode(f"after decode0 {i}: still served " * 2) for i in range(4)]
    for q in more:  # decode0 is out of rotation: the router keeps answering from decode1
        check_greedy(tp.model_dir, q, tp.generate(q, False, url), N_NEW, "after decode0")
    wait_idle(tp.node("decode1").url)
    wait_idle(tp.node("prefill1").url)
