"""The registry's HTTP API and the sync client, against a real server on an ephemeral loopback port."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from common.ports import free_port
from bootstrap_server.client import (
    bootstrap_url,
    deregister,
    health,
    list_ranks,
    lookup_layout,
    lookup_rank,
    register_rank,
)
from bootstrap_server.errors import BootstrapError, BootstrapUnreachable, RankNotRegistered
from bootstrap_server.schema import PrefillLayout, RankInfo
from bootstrap_server.server import AsyncBootstrapServer, BootstrapServer


def rank(**changes: Any) -> RankInfo:
    base = RankInfo(
        rank_ip="127.0.0.1",
        rank_port=17000,
        engine_rank=0,
        tp_size=2,
        dp_size=1,
        dp_group=0,
        pp_size=1,
        pp_rank=0,
        page_size=16,
        kv_dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
    )
    return msgspec.structs.replace(base, **changes)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer("127.0.0.1", 0)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def call(srv: BootstrapServer, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    """Raw HTTP, so the tests see statuses and bodies exactly as the server sends them."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        return resp.status, json.loads(data)
    return resp.status, data.decode()


def test_health(server: BootstrapServer) -> None:
    assert call(server, "GET", "/health") == (200, "OK")
    assert health(server.url) is True


def test_register_then_lookup_returns_the_same_entry(server: BootstrapServer) -> None:
    entry = rank(session_id="127.0.0.1:15001", instance_id="a")
    register_rank(server.url, entry)
    assert lookup_rank(server.url, engine_rank=0, dp_group=0) == entry
    assert call(server, "GET", "/route?engine_rank=0&target_dp_group=0")[1]["rank_port"] == 17000  # pp_rank defaults to 0
    # The "host:port" form the nodes pass around works too.
    assert lookup_rank(f"127.0.0.1:{server.port}", 0, 0) == entry


def test_re_registration_replaces_the_entry(server: BootstrapServer) -> None:
    assert call(server, "PUT", "/route", msgspec.json.encode(rank()))[1] == {"status": "registered"}
    restarted = rank(rank_port=17005, instance_id="second")
    assert call(server, "PUT", "/route", msgspec.json.encode(restarted))[1] == {"status": "replaced"}
    assert lookup_rank(server.url, 0, 0) == restarted
    assert len(list_ranks(server.url)) == 1


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "object"),
        (b"", "not JSON"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "rank_port": "x"}), "rank_port"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "engine_rank": 2}), "engine_rank"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "page_size": 0}), "page_size"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "kv_dtype": "fp4"}), "kv_dtype"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "rank_ip": "0.0.0.0"}), "rank_ip"),
        (msgspec.json.encode({**msgspec.structs.asdict(rank()), "extra_field": 1}), "extra_field"),
        (msgspec.json.encode({k: v for k, v in msgspec.structs.asdict(rank()).items() if k != "tp_size"}), "tp_size"),
    ],
)
def test_malformed_registration_is_400_naming_the_problem(server: BootstrapServer, raw: bytes, named: str) -> None:
    status, answer = call(server, "PUT", "/route", raw)
    assert status == 400
    assert named in answer["error"]
    assert server.registry.ranks() == []  # nothing was registered


def test_client_reports_the_servers_reason(server: BootstrapServer) -> None:
    # page_size 0 passes construction (msgspec checks ranges when decoding) and is refused by the server.
    with pytest.raises(BootstrapError, match="page_size") as err:
        register_rank(server.url, rank(page_size=0))
    assert err.value.status == 400 and type(err.value) is BootstrapError


def test_layout_mismatch_with_a_registered_rank_is_400(server: BootstrapServer) -> None:
    register_rank(server.url, rank(engine_rank=0))
    with pytest.raises(BootstrapError, match="page_size 32 != 16") as err:
        register_rank(server.url, rank(engine_rank=1, rank_port=17001, page_size=32))
    assert err.value.status == 400
    assert lookup_layout(server.url).page_size == 16


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("", "missing query parameter 'engine_rank'"),
        ("engine_rank=0", "missing query parameter 'target_dp_group'"),
        ("engine_rank=x&target_dp_group=0", "engine_rank='x' is not an integer"),
        ("engine_rank=0&target_dp_group=0&target_pp_rank=1.5", "target_pp_rank"),
        ("engine_rank=-1&target_dp_group=0", "-1 is only valid"),
        ("engine_rank=0&target_dp_group=0&target_pp_rank=-1", "-1 is only valid"),
        ("engine_rank=-2&target_dp_group=-2", "out of range"),
        ("engine_rank=0&target_dp_group=0&engine_rank=1", "given 2 times"),
        ("engine_rank=0&target_dp_group=0&tp_rank=0", "unknown query parameter 'tp_rank'"),
        ("engine_rank=0&target_dp_group=0&instance_id=a", "unknown query parameter 'instance_id'"),
    ],
)
def test_bad_lookup_query_is_400(server: BootstrapServer, query: str, named: str) -> None:
    status, answer = call(server, "GET", f"/route?{query}")
    assert (status, named in answer["error"]) == (400, True), answer


def test_lookup_outside_the_registered_layout_is_400_not_a_404_to_retry(server: BootstrapServer) -> None:
    register_rank(server.url, rank())
    status, answer = call(server, "GET", "/route?engine_rank=2&target_dp_group=0")
    assert status == 400 and "tp_size 2" in answer["error"]
    assert call(server, "GET", "/route?engine_rank=0&target_dp_group=1")[0] == 400
    assert call(server, "GET", "/route?engine_rank=0&target_dp_group=0&target_pp_rank=1")[0] == 400


def test_unknown_rank_is_404_and_the_client_gives_up_after_its_timeout(server: BootstrapServer) -> None:
    status, answer = call(server, "GET", "/route?engine_rank=1&target_dp_group=0")
    assert status == 404 and "engine_rank=1" in answer["error"]
    start = time.monotonic()
    with pytest.raises(RankNotRegistered, match="not registered"):
        lookup_rank(server.url, 1, 0, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 1.5


def test_lookup_waits_for_a_rank_that_registers_late(server: BootstrapServer) -> None:
    late = threading.Timer(0.3, register_rank, args=(server.url, rank()))
    late.start()
    try:
        start = time.monotonic()
        assert lookup_rank(server.url, 0, 0, timeout_s=5.0) == rank()
        assert time.monotonic() - start < 3.0
    finally:
        late.cancel()
        late.join()


def test_layout_query(server: BootstrapServer) -> None:
    assert call(server, "GET", "/route?engine_rank=-1&target_dp_group=-1")[0] == 404
    with pytest.raises(RankNotRegistered):
        lookup_layout(server.url, timeout_s=0)
    register_rank(server.url, rank(engine_rank=0, rank_port=17000, transfer_backend="fake"))
    layout = lookup_layout(server.url)
    assert layout == PrefillLayout(
        tp_size=2, dp_size=1, pp_size=1, page_size=16, kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
        transfer_backend="fake", registered_ranks=1,
    )
    assert not layout.complete
    register_rank(server.url, rank(engine_rank=1, rank_port=17001, transfer_backend="fake"))
    assert lookup_layout(server.url).complete
    assert call(server, "GET", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")[0] == 200


def test_layout_lookup_for_a_decode_waits_for_every_rank(server: BootstrapServer) -> None:
    heads = dict(total_kv_heads=4, num_kv_heads=2)
    register_rank(server.url, rank(engine_rank=0, rank_port=17000, kv_head_start=0, **heads))
    with pytest.raises(RankNotRegistered, match="1 of 2 ranks registered"):
        lookup_layout(server.url, timeout_s=0.3, complete=True)
    late = threading.Timer(0.3, register_rank, (server.url, rank(engine_rank=1, rank_port=17001, kv_head_start=2,
                                                                **heads)))
    late.start()
    try:
        layout = lookup_layout(server.url, timeout_s=5.0, complete=True)
    finally:
        late.join()
    assert layout.complete and (layout.total_kv_heads, layout.num_kv_heads) == (4, 2)


def test_deregister(server: BootstrapServer) -> None:
    register_rank(server.url, rank(engine_rank=0, rank_port=17000, instance_id="i0"))
    register_rank(server.url, rank(engine_rank=1, rank_port=17001, instance_id="i1"))
    # A dead incarnation's late DELETE must not remove the live entry.
    assert call(server, "DELETE", "/route?engine_rank=0&target_dp_group=0&instance_id=old")[0] == 409
    assert deregister(server.url, 0, 0, instance_id="old") is False
    assert deregister(server.url, 0, 0, instance_id="i0") is True
    assert deregister(server.url, 0, 0) is False
    assert call(server, "DELETE", "/route?engine_rank=0&target_dp_group=0")[0] == 404
    assert call(server, "GET", "/route?engine_rank=0&target_dp_group=0")[0] == 404
    assert call(server, "DELETE", "/route?engine_rank=zero&target_dp_group=0")[0] == 400
    assert call(server, "DELETE", "/route?engine_rank=-1&target_dp_group=-1&instance_id=i1")[0] == 400
    assert deregister(server.url, -1, -1) is True
    assert list_ranks(server.url) == []
    assert deregister(server.url, -1, -1) is False


def test_routes_lists_every_rank_in_order(server: BootstrapServer) -> None:
    register_rank(server.url, rank(engine_rank=1, rank_port=17001))
    register_rank(server.url, rank(engine_rank=0, rank_port=17000))
    assert [r.engine_rank for r in list_ranks(server.url)] == [0, 1]


def test_http_edges(server: BootstrapServer) -> None:
    assert call(server, "POST", "/route", b"{}")[0] == 405
    assert call(server, "PUT", "/route", b"x" * (65 * 1024))[0] == 413


def test_dead_port_is_unreachable_quickly() -> None:
    url = bootstrap_url("127.0.0.1", free_port())
    start = time.monotonic()
    with pytest.raises(BootstrapUnreachable):
        lookup_rank(url, 0, 0, timeout_s=5.0)
    with pytest.raises(BootstrapUnreachable):
        register_rank(url, rank())
    assert health(url) is False
    assert time.monotonic() - start < 2.0


def test_stop_closes_the_port_and_a_busy_port_fails_start() -> None:
    srv = BootstrapServer("127.0.0.1", 0)
    srv.start()
    srv.start()  # idempotent
    port = srv.port
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            BootstrapServer("127.0.0.1", port).start()
        assert health(srv.url)
    finally:
        srv.stop()
    srv.stop()  # idempotent
    assert health(bootstrap_url("127.0.0.1", port)) is False


def test_async_server_in_a_running_loop() -> None:
    async def scenario() -> RankInfo:
        async with AsyncBootstrapServer("127.0.0.1", 0) as srv:
            # The sync client blocks, so it runs beside the loop like the transfer threads do.
            await asyncio.to_thread(register_rank, srv.url, rank())
            return await asyncio.to_thread(lookup_rank, srv.url, 0, 0)

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == rank()


def test_bootstrap_url_forms() -> None:
    assert bootstrap_url("10.0.0.2", 8998) == "http://10.0.0.2:8998"
    assert bootstrap_url("::1", 8998) == "http://[::1]:8998"
    assert bootstrap_url("0.0.0.0", 8998) == "http://127.0.0.1:8998"
    assert bootstrap_url("prefill-0", 8998) == "http://prefill-0:8998"


def test_health_follows_the_embedders_check() -> None:
    state: dict[str, bool | None] = {"healthy": True}

    def probe() -> bool:
        if state["healthy"] is None:
            raise RuntimeError("scheduler gone")
        return bool(state["healthy"])

    with BootstrapServer("127.0.0.1", 0, health_check=probe) as srv:
        assert health(srv.url) is True
        state["healthy"] = False
        assert call(srv, "GET", "/health") == (503, "unhealthy")
        assert health(srv.url) is False
        state["healthy"] = None
        status, text = call(srv, "GET", "/health")
        assert status == 503 and "scheduler gone" in text
