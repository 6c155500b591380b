"""A fresh ``pdcluster up`` is locked down without the user doing anything: it makes a cluster
secret and an operator key for its run, so nothing reaches a node, the registry or the router's
operator endpoints without credentials, and a client key opens generation but no operator
endpoint. The command runs as users run it (a child process, its printed addresses parsed) and is
stopped with SIGTERM, as Ctrl-C would; its run directory and children are gone afterwards."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.cluster import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KEY = "e2e-client-key-0123456789abcdef"


@dataclass
class Up:
    proc: subprocess.Popen
    router: str
    prefill: str
    decode: str
    bootstrap: str
    run_dir: str


@pytest.fixture(scope="module")
def up(tiny_qwen3: str) -> Iterator[Up]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDC_")}
    env.update(PDC_LOG_LEVEL="WARNING", PDC_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "common.cli", "up", "--model-path", tiny_qwen3, "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while not any("cluster up" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "pdcluster up exited:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "pdcluster up did not come up:\n" + "".join(lines)
        text = "".join(lines)
        prefill = re.search(r"prefill node (http://\S+) \(bootstrap port (\d+)\)", text)
        decode = re.search(r"decode node (http://\S+)", text)
        router = re.search(r"router\s+(http://\S+)", text)
        secret = re.search(r"cluster secret: made for this run, in (\S+)/cluster-secret", text)
        assert prefill and decode and router and secret, text
        assert "operator key  : made for this run" in text, text
        yield Up(proc, router.group(1), prefill.group(1), decode.group(1),
                 f"http://127.0.0.1:{prefill.group(2)}", secret.group(1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_fresh_up_answers_strangers_401_and_client_keys_403(up: Up) -> None:
    # The run's secrets exist only for its owner.
    for name in ("cluster-secret", "operator-key"):
        mode = os.stat(os.path.join(up.run_dir, name)).st_mode & 0o777
        assert mode == 0o600, (name, oct(mode))
    assert os.stat(up.run_dir).st_mode & 0o077 == 0

    gen = {"text": "who may talk to the nodes?", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    client = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(up.router + "/generate", json=gen, headers=client, timeout=60)
    assert r.status_code == 200, r.text  # the cluster works for a client with its key
    workers = httpx.get(up.router + "/workers", headers=client, timeout=10).json()

    # Straight to a node or the registry, without credentials or with the client key: 401.
    for method, url, body in [("POST", up.prefill + "/generate", gen), ("POST", up.decode + "/generate", gen),
                              ("POST", up.decode + "/abort_request", {"abort_all": True}),
                              ("GET", up.prefill + "/debug/memory", None),
                              ("DELETE", up.bootstrap + "/route?engine_rank=-1&target_dp_group=-1", None),
                              ("GET", up.bootstrap + "/routes", None)]:
        for headers in ({}, client):
            r = httpx.request(method, url, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, f"{method} {url} {headers}: {r.status_code} {r.text}"

    # The router's operator endpoints: 401 without a key, 403 with a client key, nothing changed.
    operator = [("POST", "/workers", {"url": "http://127.0.0.1:9", "role": "decode"}),
                ("DELETE", f"/workers?url={up.decode}", None), ("POST", "/flush_cache", None),
                ("POST", "/abort_request", {"abort_all": True})]
    for method, path, body in operator:
        assert httpx.request(method, up.router + path, json=body, timeout=10).status_code == 401, path
        r = httpx.request(method, up.router + path, json=body, headers=client, timeout=10)
        assert r.status_code == 403, f"{path} with a client key: {r.status_code} {r.text}"
    assert httpx.get(up.router + "/workers", headers=client, timeout=10).json() == workers
    routes = httpx.get(up.router + "/health", timeout=10).json()
    assert routes["healthy_prefill"] == 1 and routes["healthy_decode"] == 1, routes  # the registry kept its rank
    r = httpx.post(up.router + "/generate", json=gen, headers=client, timeout=60)
    assert r.status_code == 200, r.text


def test_stopping_up_removes_its_secrets(up: Up) -> None:
    os.killpg(up.proc.pid, signal.SIGTERM)
    assert up.proc.wait(60) is not None
    assert up.proc.stdout is not None
    up.proc.stdout.read()  # drain what it printed on the way out
    assert not os.path.exists(up.run_dir), "the run directory (with the secrets) outlived the run"
