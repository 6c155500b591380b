"""Two requests that share a bootstrap room (a client choosing it at the nodes, not our router)
never swap outputs: real processes over real Mooncake, one prefill and one or two decodes.

Each trial sends prompt A to the prefill and decode 1 and prompt B to the prefill and decode 2
(or decode 1 too, in every other trial), all with the same room, in a random order with random
gaps. Whatever wins the races, a decode that answers 200 answers with its own prompt's HF greedy
tokens: a node refuses the second live room (409) and the prefill writes a room only to a decode
that holds it for the same prompt (the TransferInfo's prompt digest), so the loser fails with a
reason, at once: the other half of a refused pair never waits out a timeout. Every node ends idle.

``SHARED_ROOM_TRIALS`` sets the number of trials (CI: 8; ``make shared-room``: 200).
"""
from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.cluster import Cluster, Node, check_greedy, start_node, wait_healthy, wait_idle

TRIALS = int(os.environ.get("SHARED_ROOM_TRIALS", "8"))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300 + 10 * TRIALS)]
N = 4


@pytest.fixture(scope="module")
def cluster(qwen3_pair: Cluster) -> Iterator[tuple[Cluster, Node]]:
    """The session's qwen3 pair and a second decode node of this module's own (killed when the
    module is done: the pair goes on serving other modules)."""
    c = qwen3_pair
    d2 = start_node("decode", c.model_dir, c.common_args, None, os.path.dirname(c.prefill.log_path))
    try:
        wait_healthy([d2])
        yield c, d2
    finally:
        d2.kill()


def test_requests_that_share_a_room_fail_or_get_their_own_tokens(cluster: tuple[Cluster, Node]) -> None:
    c, d2 = cluster
    rng = random.Random(7)
    served = {"A": 0, "B": 0}
    with ThreadPoolExecutor(4) as ex:
        for trial in range(TRIALS):
            room = rng.randrange(2**62)
            prompts = {"A": [rng.randrange(10, 500) for _ in range(rng.randrange(8, 40))],
                       "B": [rng.randrange(10, 500) for _ in range(rng.randrange(8, 40))]}
            decode_b = d2 if trial % 2 == 0 else c.decode  # two decodes, then one
            legs = [(c.prefill.url, "A", True), (c.decode.url, "A", False), (c.prefill.url, "B", True),
                    (decode_b.url, "B", False)]
            rng.shuffle(legs)
            futures = []
            for url, who, is_prefill in legs:
                body = {"input_ids": prompts[who], "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                                                       "ignore_eos": True},
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": c.bootstrap_port, "bootstrap_room": room,
                        "rid": f"t{trial}-{who}-{'p' if is_prefill else 'd'}", **({"stream": True} if is_prefill else {})}
                futures.append((who, is_prefill, ex.submit(httpx.post, url + "/generate", json=body, timeout=60)))
                time.sleep(rng.random() * 0.05)
            # Decode halves first. One the decode refused itself (409: the room is live there for
            # the other prompt) never reaches the prefill, which would wait out its bootstrap
            # timeout for it: a client (our router) aborts its prefill half, and so does this test.
            results = {}
            for who, is_prefill, fut in sorted(futures, key=lambda f: f[1]):
                r = results[(who, is_prefill)] = fut.result()
                if not is_prefill and r.status_code == 409:
                    httpx.post(c.prefill.url + "/abort_request", json={"rid": f"t{trial}-{who}-p"}, timeout=10)
            for (who, is_prefill), r in results.items():
                # Otherwise a refused half fails its other half at once (transfer/prefill_control.py):
                # neither waits for a TransferInfo or a request that cannot come.
                assert r.status_code == 200 or not re.search(r"timeout|within", r.text), (trial, who, is_prefill, r.text)
                if is_prefill:
                    assert r.status_code in (200, 409, 503), (trial, who, r.status_code, r.text)
                    continue
                if r.status_code == 200:
                    check_greedy(c.model_dir, prompts[who], r.json()["output_ids"], N,
                                 f"trial {trial}: decode of {who} answered 200")
                    served[who] += 1
                else:
                    assert r.status_code in (409, 502, 503) and r.json()["error"]["message"], (trial, who, r.text)
    assert served["A"] + served["B"] >= TRIALS // 2, served  # the winners were served
    c.wait_idle()
    wait_idle(d2.url)
