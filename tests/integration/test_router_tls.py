"""TLS at the router (``--ssl-certfile`` / ``--ssl-keyfile``): the official ``openai`` client
reaches it over HTTPS with a CA made here by the ``openssl`` command, a client that does not
trust that CA is refused at the handshake, and plain HTTP to the TLS port gets no answer. The
workers are the scripted stand-ins of test_router_http.py."""
from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from router.app import serve_options
from router.config import ConfigError, parse_config
from tests.integration.test_router_http import ok_decode, ok_prefill, router_over

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
openai = pytest.importorskip("openai")

KEY = "tls-client-key-0123456789abcdef"


def make_ca_and_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate for 127.0.0.1, its key), made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=pdcluster test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    return tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"


def test_the_openai_client_over_https_with_a_test_ca(tmp_path: Path) -> None:
    ca, cert, key = make_ca_and_cert(tmp_path)
    cfg = parse_config(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--api-key", KEY])
    server_ctx = serve_options(cfg)["ssl_context"]
    client_ctx = ssl.create_default_context(cafile=str(ca))

    async def body() -> None:
        async with router_over([ok_prefill], [ok_decode], "--api-key", KEY, ssl_context=server_ctx,
                               client_ssl=client_ctx, headers={"Authorization": f"Bearer {KEY}"}) as c:
            assert c.url.startswith("https://")
            async with httpx.AsyncClient(verify=client_ctx) as http:
                client = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key=KEY, http_client=http, max_retries=0)
                out = await client.completions.create(model="m", prompt="hi", max_tokens=2)
                # The scripted decode's answer came back through TLS, and the prompt reached it.
                assert out.model_extra and out.model_extra["text"] == "abc", out
                assert c.decodes[0].received[-1]["prompt"] == "hi"
                models = await client.models.list()
                assert [m.id for m in models.data] == ["m"]
            # A client that does not trust the CA fails the handshake; plain HTTP gets no answer.
            async with httpx.AsyncClient() as untrusting:
                with pytest.raises(httpx.ConnectError):
                    await untrusting.get(c.url + "/health")
            async with httpx.AsyncClient(timeout=5) as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get(c.url.replace("https://", "http://") + "/health")

    asyncio.run(body())


def test_certificate_flags_are_checked_before_anything_listens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --ssl-certfile"):
        parse_config(["--ssl-keyfile", str(tmp_path / "k.pem")])
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="cannot load"):
        serve_options(parse_config(["--ssl-certfile", str(tmp_path / "bad.pem")]))
