"""The router's live page in headless Chromium, over a real cluster: our router in front of
1 prefill + 1 decode (tiny qwen3, Mooncake TCP), launched as ``pdcluster up`` does.

    streamed requests, then more of them, one after another, while Chromium runs
      -> Chromium loads /dashboard (virtual time: several refreshes), its DOM is parsed:
         both nodes listed, healthy, with live numbers (requests routed after the page opened,
         KV pages, queues, TTFT, TPOT, tokens/s)
      -> the traffic stops, both nodes return to idle (the leak check)
      -> the decode is killed: the page still renders, the decode row unhealthy with the error

Chromium is Debian's ``chromium`` package, installed by ``make test-deps`` (part of ``make
test``); without it the test skips and says so. Each Chromium run is bounded and killed by its
process group.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser

import httpx
import pytest

from common.tools.local_cluster import LocalCluster
from tests.e2e.cluster import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHROMIUM_TIMEOUT_S = 60.0
VIRTUAL_TIME_MS = 4000  # page time Chromium runs before dumping: several refreshes at ?refresh=1
ROUTER_ARGS = ["--health-check-interval-s", "0.5", "--health-failure-threshold", "2", "--load-poll-interval-s", "0.5"]
GEN = {"temperature": 0, "ignore_eos": True}


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("Chromium is not installed: `make test-deps` (scripts/install_test_deps.sh) installs Debian's "
                "chromium package; it was not run here or apt-get could not install it")


def dump_dom(url: str) -> str:
    """The page's DOM after VIRTUAL_TIME_MS of page time (timers run, fetches are awaited)."""
    with tempfile.TemporaryDirectory(prefix="pdc-chromium-") as profile:
        argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", f"--user-data-dir={profile}",
                f"--virtual-time-budget={VIRTUAL_TIME_MS}", "--dump-dom", url]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out, err = "", f"no DOM within {CHROMIUM_TIMEOUT_S:g} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its renderer and GPU helpers too
            proc.wait(timeout=10)
    assert "<table" in out, f"Chromium gave no page (exit {proc.returncode}): {err[-2000:]}"
    return out


class Page(HTMLParser):
    """The dumped page: each worker row's cells by data-field (text and data-* attributes)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.fields: dict[str, str] = {}  # summary fields outside the table
        self.rows: dict[str, dict] = {}  # url -> {"role", "healthy", field: {"text", attrs...}}
        self._row: dict | None = None
        self._cells: list[dict] = []  # open elements with a data-field, innermost last
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if tag == "tr" and "data-url" in a:
            self._row = self.rows[a["data-url"]] = {"role": a["data-role"], "healthy": a["data-healthy"] == "true"}
        for cell in self._cells if "data-field" not in a else ():
            if cell["tag"] == tag:
                cell["nested"] += 1  # an inner plain element of the same tag: its end tag is not the cell's
        if "data-field" in a:
            cell = {**a, "text": "", "tag": tag, "nested": 0}
            self._cells.append(cell)
            (self._row if self._row is not None else self.fields).setdefault(a["data-field"], cell)

    def handle_endtag(self, tag: str) -> None:
        for cell in reversed(self._cells):
            if cell["tag"] == tag:
                if cell["nested"]:
                    cell["nested"] -= 1
                else:
                    self._cells.remove(cell)
                break
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        for cell in self._cells:
            cell["text"] += data


@pytest.fixture(scope="module")
def cluster(tiny_model_factory: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    chromium()  # skip before starting anything
    c = LocalCluster(logdir=str(tmp_path_factory.mktemp("pdc-dashboard-e2e")))
    try:
        assert c.start(tiny_model_factory("qwen3"), backend="mooncake", num_prefill=1, num_decode=1, router="ours",
                       router_args=ROUTER_ARGS, startup_timeout_s=180) is not None
        yield c
    except BaseException:
        print(c.log_tails(60))
        raise
    finally:
        c.stop()


def test_dashboard_in_chromium_shows_every_node_live(cluster: LocalCluster) -> None:
    url = cluster.router_url
    p, d = cluster.prefills[0], cluster.decodes[0]
    def stream(i: int) -> None:  # streamed: the router measures their TTFT and TPOT
        body = {"text": f"dashboard request {i}", "sampling_params": {"max_new_tokens": 16, **GEN}, "stream": True}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert r.read().endswith(b"data: [DONE]\n\n")

    for i in range(4):
        stream(i)
    # Traffic goes on while Chromium runs, so what the page shows last was fetched after requests
    # that came after the page was opened: live numbers, not a first snapshot.
    stop, sent, errors = threading.Event(), [0], []

    def traffic() -> None:
        try:
            while not stop.is_set():
                stream(100 + sent[0])
                sent[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        routed_before = {w["url"]: w["routed"] for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"]}
        t0 = time.monotonic()
        page = Page(dump_dom(f"{url}/dashboard?refresh=1"))
        print(f"chromium run (live): {time.monotonic() - t0:.1f} s, {sent[0]} requests meanwhile")
    finally:
        stop.set()
        t.join(timeout=60)
    assert not t.is_alive() and not errors, errors

    assert int(page.body.get("data-updates", "0")) >= 2, f"the page did not refresh on its own: {page.body}"
    assert page.fields["cluster-status"]["text"] == "ok"
    assert set(page.rows) == {p.url, d.url}, page.rows.keys()
    for node in (p, d):
        row = page.rows[node.url]
        assert row["role"] == node.role and row["healthy"], row
        assert row["health"]["data-state"] == "healthy", row["health"]
        assert int(row["kv"]["data-total-pages"]) > 0, row["kv"]
        inflight, routed = (int(v) for v in row["inflight"]["text"].split("/"))
        assert routed > routed_before[node.url] >= 4 and inflight >= 0, (row["inflight"], routed_before)
        assert int(row["load"]["text"]) >= 0, row["load"]
        assert int(row["ttft"]["data-n"]) >= 4 and float(row["ttft"]["data-p50"]) > 0, row["ttft"]
        assert row["ttft"]["text"].endswith("ms")
    drow = page.rows[d.url]
    # A short stream whose frames all reach the router in one read has no TPOT: most have one.
    assert int(drow["tpot"]["data-n"]) >= 1 and float(drow["tpot"]["data-p50"]) > 0, drow["tpot"]
    assert int(drow["kv"]["data-total-pages"]) > int(drow["kv"]["data-used-pages"]) >= 0, drow["kv"]
    for node, names in ((p, ("bootstrap", "waiting", "chunked", "transferring")),
                        (d, ("prealloc", "transfer", "waiting", "running", "retracted", "draining"))):
        text = page.rows[node.url]["queues"]["text"]
        assert all(re.search(rf"\b{name} \d+", text) for name in names), text
    for node in (p, d):  # prompt tokens/s and generated tokens/s over the node's last 10 s
        assert float(page.rows[node.url]["throughput"]["text"]) > 0, page.rows[node.url]["throughput"]

    for node in (p, d):
        wait_idle(node.url)  # the closed stream left nothing behind

    # A dead worker: the page still renders, the row says why.
    cluster.kill(d.name)
    deadline = time.monotonic() + 20
    while any(w["healthy"] for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"] if w["url"] == d.url):
        assert time.monotonic() < deadline, "the router did not notice the killed decode"
        time.sleep(0.2)
    t0 = time.monotonic()
    page = Page(dump_dom(f"{url}/dashboard?refresh=1"))
    print(f"chromium run (dead decode): {time.monotonic() - t0:.1f} s")
    assert page.fields["cluster-status"]["text"] == "unavailable"
    dead = page.rows[d.url]
    assert not dead["healthy"] and dead["health"]["data-state"] == "unhealthy"
    assert dead["error"]["text"], dead
    assert dead["kv"]["text"] == "–"
    assert page.rows[p.url]["healthy"] and int(page.rows[p.url]["kv"]["data-total-pages"]) > 0
