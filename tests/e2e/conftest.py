"""Fixtures of the e2e tier; the helpers (process start/kill, router-shaped requests, idle-memory
checks, the HF comparison) live in ``tests/e2e/cluster.py``.

    qwen3_pair   a prefill node + a decode node over real Mooncake TCP on loopback, qwen3, default
                 flags; one for the whole session (each start-up is seconds of CPU on a 2-core
                 CI box), shared by test_decode_pd, test_sglang_router (its router in front)
                 and test_shared_room (a second decode beside it), so every module using it
                 must leave both nodes idle, as its tests check anyway
    pd_cluster   the same pair, one per tiny arch (tests using it run for qwen3 and llama): the
                 qwen3 one is ``qwen3_pair``; the llama one is the module's own, torn down
                 (process groups killed) when the module is done with it. The llama pair's
                 decode streams every 3 tokens (--stream-interval 3), so every streamed check in
                 those tests also runs on multi-token chunks, and keeps its own prefix cache
                 (--disaggregation-decode-enable-radix-cache), so they also run with decode reuse
    scripted_routed  our router over a prefill + a decode node on a *scripted* tiny qwen3
                 (``make-tiny-model --script TOOL_CALL_SCRIPT``: after any chat prompt its greedy
                 output is a Hermes tool call, then EOS; any other context gives random tokens),
                 one for the session, shared by test_fuzz_http (whose oracle never reads what the
                 model says) and test_tool_call_auto (which needs a model that writes a call)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import TOOL_CALL_SCRIPT, Cluster, running_cluster


@pytest.fixture(scope="session")
def qwen3_pair(tiny_qwen3: str) -> Iterator[Cluster]:
    with running_cluster(tiny_qwen3) as c:
        yield c


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pd_cluster(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> Iterator[Cluster]:
    if request.param == "qwen3":
        yield request.getfixturevalue("qwen3_pair")
        return
    # --cpu-linear native: our kernel's layout insisted on (auto picks it too where it builds), so
    # this decode node's steps run as one call of the whole-step kernel (common/models/native_decode.py).
    with running_cluster(tiny_model_factory(request.param),
                         decode_args=["--stream-interval", "3", "--disaggregation-decode-enable-radix-cache",
                                      "--cpu-linear", "native"]) as c:
        yield c


@pytest.fixture(scope="session")
def scripted_routed(tiny_model_factory: Callable[..., str],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str]]:
    """(the cluster, the router's URL); the short bootstrap/waiting timeouts are test_fuzz_http's
    (a fuzzed body with bootstrap fields pointing nowhere must fail fast)."""
    c = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-scripted-e2e")),
                     env={"PDC_BOOTSTRAP_TIMEOUT_S": "3", "PDC_WAITING_TIMEOUT_S": "5"})
    try:
        url = c.start(tiny_model_factory("qwen3", script=TOOL_CALL_SCRIPT), backend="mooncake", num_prefill=1,
                      num_decode=1, router="ours", router_args=["--request-timeout-s", "20", "--health-check-interval-s", "1"],
                      startup_timeout_s=180)
        assert url is not None
        yield c, url
    except BaseException:
        print(c.log_tails(40))
        raise
    finally:
        c.stop()
