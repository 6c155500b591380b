"""A whole cluster with both secrets set: 1 prefill + 1 decode node (real Mooncake over TCP, tiny
qwen3) behind our router, launched as ``pdcluster up --api-key K --cluster-secret S`` launches it
(common/tools/local_cluster.py: the secrets reach the children through their environment).

    a client with the API key       is served, token for token equal to HF greedy (the router,
                                    the registry lookup, the sealed control plane and Mooncake all
                                    worked with the secret)
    a client without it / wrong     401 from the router, nothing reaches a node
    a stranger at the nodes         401 from /generate, /abort_request, /flush_cache, /debug/memory
                                    and the registry's PUT /route; the registry keeps its one rank
    a stranger at the control port  an unsealed Ping gets no Pong, the cluster serves on

The test ends with both nodes back at idle memory (the leak check).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import zmq

from common.tokenizer import Tokenizer
from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import check_greedy, check_greedy_text, wait_idle
from transfer import messages as m

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KEY = "e2e-api-key-0123456789abcdef"
SECRET = "e2e-cluster-secret-0123456789abcdef"
TIMEOUT_S = 60.0


@dataclass
class Secured:
    cluster: LocalCluster
    url: str
    model_dir: str
    tok: Tokenizer

    @property
    def prefill(self) -> str:
        return self.cluster.prefills[0].url

    @property
    def decode(self) -> str:
        return self.cluster.decodes[0].url


@pytest.fixture(scope="module")
def secured(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    model_dir = tiny_model_factory("qwen3")
    cluster = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-auth-e2e")), cluster_secret=SECRET, api_key=KEY)
    try:
        url = cluster.start(model_dir, backend="mooncake", num_prefill=1, num_decode=1, router="ours",
                            router_args=["--health-check-interval-s", "0.5"], startup_timeout_s=180)
        assert url is not None
        yield Secured(cluster, url, model_dir, Tokenizer(model_dir))
    except BaseException:
        print(cluster.log_tails(60))
        raise
    finally:
        cluster.stop()


def test_a_client_with_the_key_is_served_exactly_and_strangers_are_refused(secured: Secured) -> None:
    s = secured
    # Refused at the router: no key, a wrong one, the cluster secret (it is not a client key).
    prompt = s.tok.encode("access control keeps strangers out of")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    for headers in ({}, {"Authorization": "Bearer not-the-key-0123456789abcdef"}, {"Authorization": f"Bearer {SECRET}"}):
        r = httpx.post(s.url + "/generate", json=body, headers=headers, timeout=TIMEOUT_S)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", r.text
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # probes stay open

    # Served: /generate (token ids) and the official client (its api_key is the bearer token).
    r = httpx.post(s.url + "/generate", json=body, headers=s.cluster.headers(), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    check_greedy(s.model_dir, prompt, r.json()["output_ids"], 8, "generate with both secrets")
    with openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S) as client:
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "who may reach the decode node?"}]
        for stream in (False, True):
            resp = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=stream,
                                                  temperature=0, extra_body={"ignore_eos": True})
            text = ("".join(c.choices[0].delta.content or "" for c in resp if c.choices) if stream
                    else resp.choices[0].message.content)
            check_greedy_text(s.model_dir, s.tok.decode, list(s.tok.apply_chat_template(msgs, add_generation_prompt=True)),
                              text or "", 6, f"openai chat stream={stream}")
    with openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong-key-0123456789abcdef", max_retries=0) as wrong, \
            pytest.raises(openai.AuthenticationError):
        wrong.models.list()

    # Refused at the nodes without the cluster secret, open with it.
    bootstrap = f"http://127.0.0.1:{s.cluster.prefills[0].bootstrap_port}"
    for method, url, payload in [("POST", s.prefill + "/generate", body), ("POST", s.decode + "/v1/completions", {}),
                                 ("POST", s.decode + "/abort_request", {"abort_all": True}),
                                 ("POST", s.prefill + "/flush_cache", None), ("GET", s.decode + "/debug/memory", None),
                                 ("PUT", bootstrap + "/route", {"rank_ip": "10.6.6.6"}), ("GET", bootstrap + "/routes", None)]:
        # The client key opens no node, and neither does the bare secret: only request tokens do.
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {SECRET}"}):
            r = httpx.request(method, url, json=payload, headers=headers, timeout=10)
            assert r.status_code == 401, f"{method} {url} {headers}: {r.status_code} {r.text}"
    routes = httpx.get(bootstrap + "/routes", headers=s.cluster.node_headers("GET", bootstrap + "/routes"), timeout=10).json()
    assert len(routes) == 1 and routes[0]["rank_ip"] == "127.0.0.1"  # the refused PUT changed nothing

    # A stranger on the prefill's control port: its unsealed Ping is dropped, not answered.
    endpoint = f"tcp://{routes[0]['rank_ip']}:{routes[0]['rank_port']}"
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(endpoint)
        push.send(msgspec.msgpack.encode(m.Ping(seq=1, session_id="stranger", status_endpoint=f"tcp://127.0.0.1:{port}")))
        assert pull.poll(1500) == 0, "the prefill answered an unauthenticated Ping"
    finally:
        ctx.destroy(linger=0)
    r = httpx.post(s.url + "/generate", json=body, headers=s.cluster.headers(), timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["output_ids"] == httpx.post(
        s.url + "/generate", json=body, headers=s.cluster.headers(), timeout=TIMEOUT_S).json()["output_ids"]

    for n in s.cluster.nodes:  # the leak check
        wait_idle(n.url, secret=SECRET)


def test_a_decode_aimed_at_a_strangers_registry_fails_fast_and_holds_nothing(secured: Secured) -> None:
    """A request (signed, as the router would send it) whose bootstrap_host/port name a stranger's
    listener: the decode asks it, does not believe it (no proof of the secret), and fails the
    request within seconds without reserving pages or sending its KV args anywhere."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen: list[str] = []

    class Rogue(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            body = json.dumps({"rank_ip": "127.0.0.1", "rank_port": 1, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                               "page_size": 16}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None: ...

    rogue = HTTPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=rogue.serve_forever, daemon=True).start()
    try:
        prompt = secured.tok.encode("where do my keys and values go?")
        body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                           "bootstrap_host": "127.0.0.1", "bootstrap_port": rogue.server_address[1],
                           "bootstrap_room": 424242}).encode()
        url = secured.decode + "/generate"
        t0 = time.monotonic()
        r = httpx.post(url, content=body, timeout=TIMEOUT_S, headers={
            "Content-Type": "application/json", **secured.cluster.node_headers("POST", url, body)})
        assert r.status_code >= 500 and "cluster secret" in r.text, r.text
        assert time.monotonic() - t0 < 10, "a stranger's registry must fail the request fast"
        assert seen, "the decode never asked it (the test did not test anything)"
    finally:
        rogue.shutdown()
        rogue.server_close()
    wait_idle(secured.decode, secret=SECRET)
