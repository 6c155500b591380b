"""Mutual TLS between our router and a node: the node's API process for real (uvicorn with
``--ssl-certfile/--ssl-keyfile/--ssl-ca-certs``, a fake scheduler behind it) and the real router
with ``--worker-ssl-ca-certs/--worker-ssl-certfile/--worker-ssl-keyfile``, over certificates
made here by the ``openssl`` CLI (skipped without it).

A node given a CA refuses every client without a certificate it signed, at the handshake
(``/health`` included); the router holding one proves the node healthy and serves a request
through it; a router without one never sees the node healthy and answers 503.
"""
from __future__ import annotations

import asyncio
import gc
import shutil
import ssl
import subprocess
import warnings
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.integration.test_api_process import expected_ids, spawn_node, stop_node
from tests.integration.test_router_http import Fake, ok_prefill
from router.app import create_app
from router.config import parse_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
STARTUP_S = 90.0


def make_certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pdc-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pdc-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {k: str(d / f"{k}") for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def client_context(certs: dict[str, str], with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    if with_cert:
        ctx.load_cert_chain(certs["client.pem"], certs["client.key"])
    return ctx


def wait_tls_healthy(url: str, certs: dict[str, str]) -> None:
    import time

    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(url + "/health", timeout=1, verify=client_context(certs, True)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the TLS node was not healthy in {STARTUP_S} s"
        time.sleep(0.2)


async def through_router(decode_url: str, certs: dict[str, str], with_cert: bool) -> tuple[int, dict]:
    """One /generate through a router over a scripted prefill and the TLS decode."""
    prefill = await Fake(ok_prefill).start()
    flags = ["--worker-ssl-ca-certs", certs["ca.pem"]]
    if with_cert:
        flags += ["--worker-ssl-certfile", certs["client.pem"], "--worker-ssl-keyfile", certs["client.key"]]
    cfg = parse_config(["--health-check-interval-s", "0.1", "--load-poll-interval-s", "0.1",
                        "--prefill", prefill.url, "9000", "--decode", decode_url, *flags])
    runner = web_runner = None
    try:
        from aiohttp import web

        runner = web_runner = web.AppRunner(create_app(cfg))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            # Healthy once the decode proved itself over TLS; without a certificate it never does
            # (ten probe rounds show it: every one fails at the handshake).
            deadline = loop.time() + (30 if with_cert else 1)
            while True:
                async with s.get(url + "/health") as r:
                    if r.status == 200 or loop.time() > deadline:
                        break
                await asyncio.sleep(0.1)
            body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
            async with s.post(url + "/generate", json=body) as r:
                return r.status, await r.json()
    finally:
        if web_runner is not None:
            await web_runner.cleanup()
        await prefill.stop()


def _collect_refused_handshakes() -> None:
    """Connections whose TLS handshake this test makes fail (no client certificate, plain HTTP
    to a TLS port) can leave a transport the client library never closed; collected here, where
    they are expected, rather than in whichever later test the garbage collector runs in (where
    the suite's warnings-as-errors would fail that test for this one's garbage)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_mutual_tls_between_the_router_and_a_node(tmp_path: Path, tiny_qwen3: str, alphabet: list[int]) -> None:
    certs = make_certs(tmp_path)
    node = spawn_node(tmp_path / "node", tiny_qwen3, "decode", alphabet, 0.0,
                      extra=("--ssl-certfile", certs["server.pem"], "--ssl-keyfile", certs["server.key"],
                             "--ssl-ca-certs", certs["ca.pem"]))
    url = node.url.replace("http://", "https://")
    try:
        wait_tls_healthy(url, certs)
        with pytest.raises(httpx.TransportError):  # no client certificate: refused at the handshake
            httpx.get(url + "/health", timeout=5, verify=client_context(certs, False))
        with pytest.raises(httpx.TransportError):  # plain HTTP reaches nothing either
            httpx.get(node.url + "/health", timeout=5)
        _collect_refused_handshakes()
        status, out = asyncio.run(through_router(url, certs, with_cert=True))
        assert status == 200 and out["output_ids"] == expected_ids(alphabet, [3, 4, 5], 3), out
        status, out = asyncio.run(through_router(url, certs, with_cert=False))
        assert status == 503 and "no healthy decode" in out["error"]["message"], out
    finally:
        stop_node(node)
        _collect_refused_handshakes()
