"""The router's view of its workers: health, load, in-flight counts, joining and leaving.

    added (healthy=False) --first good probe--> healthy --threshold bad probes, or a connection
      ^                                           |        error while forwarding--> unhealthy
      |                                           |                                   |
      |                                           `<-------- a good probe ------------'
    DELETE /workers: draining (no new requests) --last in-flight request ends--> forgotten

Two background loops share the router's one HTTP session: every ``health_check_interval_s`` a
``GET /health`` to each worker (2xx = healthy; with a cluster secret the probe carries a
challenge and only a worker that proves the secret is healthy: router/node_auth.py), and every
``load_poll_interval_s`` a ``GET /get_load`` to each healthy one; each worker's call on its own,
so a hung one delays nobody else's. A worker's load is the router's own in-flight count plus
what the node reports beyond it (requests other routers or clients sent it directly).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from router.config import WorkerSpec
from router.node_auth import NotProven, challenge_probe

log = logging.getLogger("router.workers")


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None
    healthy: bool = False  # until the first good probe
    draining: bool = False  # removed: no new requests, in-flight ones finish
    inflight: int = 0  # requests this router has on it now
    routed: int = 0  # requests this router ever sent it (attempts)
    failures: int = 0  # bad probes in a row
    last_error: str | None = None
    polled_reqs: int = 0  # the node's own count at the last /get_load
    inflight_at_poll: int = 0  # ours at that moment, so the difference is load we did not send
    queued_tokens: int = 0  # prefill: uncached prompt tokens of our requests it has not computed yet (as far as we know)

    @property
    def load(self) -> int:
        return self.inflight + max(0, self.polled_reqs - self.inflight_at_poll)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def as_dict(self) -> dict:
        return {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port, "healthy": self.healthy,
                "draining": self.draining, "load": self.load, "inflight": self.inflight, "routed": self.routed,
                "node_reqs": self.polled_reqs, "last_error": self.last_error}


class Workers:
    """The worker set. ``on_forget(url)`` runs when a worker leaves for good (policies drop it)."""

    def __init__(self, specs: tuple[WorkerSpec, ...], failure_threshold: int, on_forget: Callable[[str], None],
                 secret: str | None = None) -> None:
        self._by_url: dict[str, Worker] = {}
        self._secret = secret  # with one, a probe is healthy only if the worker proves it (router/node_auth.py)
        self._threshold = failure_threshold
        self._on_forget = on_forget
        self.changed = asyncio.Event()  # set when health or membership changes (probes kick in at once)
        self._stopping = asyncio.Event()  # set by stop(): the loops end after the probes in flight
        for spec in specs:
            self.add(spec)

    # ---- membership ------------------------------------------------------------------------------

    def add(self, spec: WorkerSpec) -> Worker:
        old = self._by_url.get(spec.url)
        if old is not None and not old.draining:
            raise ValueError(f"worker {spec.url} is already registered as {old.role}")
        if old is not None:  # re-added while draining: it stays, with its in-flight requests
            old.role, old.bootstrap_port, old.draining = spec.role, spec.bootstrap_port, False
            return old
        w = Worker(spec.url, spec.role, spec.bootstrap_port)
        self._by_url[spec.url] = w
        self.changed.set()
        return w

    def remove(self, url: str) -> Worker:
        """Start draining ``url``; it is forgotten once its last in-flight request ends."""
        w = self._by_url.get(url)
        if w is None or w.draining:
            raise KeyError(url)
        w.draining = True
        self._forget_if_drained(w)
        return w

    def _forget_if_drained(self, w: Worker) -> None:
        if w.draining and w.inflight == 0 and self._by_url.get(w.url) is w:
            del self._by_url[w.url]
            self._on_forget(w.url)

    def all(self) -> list[Worker]:
        return list(self._by_url.values())

    def get(self, url: str) -> Worker | None:
        return self._by_url.get(url)

    def candidates(self, role: str) -> list[Worker]:
        return [w for w in self._by_url.values() if w.role == role and w.healthy and not w.draining]

    # ---- request accounting ----------------------------------------------------------------------

    def hold(self, w: Worker) -> Callable[[], None]:
        """Count ``w`` busy from now on; the returned release ends it (once: later calls do nothing)."""
        w.inflight += 1
        w.routed += 1
        held = [True]

        def release() -> None:
            if held:
                held.clear()
                w.inflight -= 1
                self._forget_if_drained(w)

        return release

    @contextlib.contextmanager
    def busy(self, *workers: Worker):  # type: ignore[no-untyped-def]
        releases = [self.hold(w) for w in workers]
        try:
            yield
        finally:
            for release in releases:
                release()

    def mark_failed(self, w: Worker, reason: str) -> None:
        """A connection to ``w`` failed while forwarding: out of rotation until a probe succeeds."""
        if w.healthy:
            log.warning("worker %s (%s) leaves rotation: %s", w.url, w.role, reason)
        w.healthy, w.failures, w.last_error = False, max(w.failures, self._threshold), reason
        self.changed.set()

    # ---- probes ----------------------------------------------------------------------------------

    def probed(self, w: Worker, ok: bool, reason: str | None = None) -> None:
        if ok:
            if not w.healthy:
                log.info("worker %s (%s) is healthy", w.url, w.role)
            w.healthy, w.failures, w.last_error = True, 0, None
            return
        w.failures += 1
        w.last_error = reason
        if w.healthy and w.failures >= self._threshold:
            log.warning("worker %s (%s) leaves rotation after %d failed probes: %s", w.url, w.role, w.failures, reason)
            w.healthy = False

    async def _probe(self, session: aiohttp.ClientSession, w: Worker, timeout_s: float) -> None:
        try:
            reason = await challenge_probe(session, w.url, self._secret, timeout_s)
            self.probed(w, reason is None, reason)
        except NotProven as exc:
            # Whatever answers at that address now is not ours: out at once, not after the
            # threshold, so no request of ours reaches it.
            self.mark_failed(w, str(exc))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.probed(w, False, f"/health: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug here must not leave the worker unprobed for good
            log.exception("probe of %s failed", w.url)
            self.probed(w, False, f"/health: {type(exc).__name__}: {exc}")

    async def _poll_load(self, session: aiohttp.ClientSession, w: Worker, timeout_s: float) -> None:
        at_send = w.inflight
        try:
            async with session.get(w.url + "/get_load", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                body = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return  # the health loop judges liveness; a missed poll keeps the last figure
        if isinstance(body, list) and body and isinstance(body[0], dict):
            try:
                reqs = sum(int(d.get("num_reqs", 0) or 0) for d in body if isinstance(d, dict))
            except (TypeError, ValueError):
                return  # not a count: keep the last figure
            w.polled_reqs, w.inflight_at_poll = reqs, min(at_send, w.inflight)

    def stop(self) -> None:
        """Ask ``run`` to return: no new probe starts, the ones in flight finish (each bounded by
        its timeout). Cancelling a probe instead can leave its socket open: a TLS connect cancelled
        before asyncio started its handshake is never closed (the handshake then runs on its own
        and the connection outlives the session)."""
        self._stopping.set()
        self.changed.set()

    async def run(self, session: aiohttp.ClientSession, health_interval_s: float, load_interval_s: float,
                  timeout_s: float) -> None:
        """The two loops, until ``stop()``. A membership change probes at once, not a period later."""

        async def pause(event: asyncio.Event, seconds: float) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), seconds)

        def each(tasks: dict[str, asyncio.Task], workers: list[Worker],
                 call: Callable[[aiohttp.ClientSession, Worker, float], Awaitable[None]]) -> dict[str, asyncio.Task]:
            """A call per worker, each its own task: a hung worker (stopped, not dead) holds only its
            own call for the timeout while the others keep the period, so a node back from a
            restart rejoins within a period of answering. A worker whose last call is still in
            flight is skipped this round (one at a time per worker)."""
            tasks = {url: t for url, t in tasks.items() if not t.done()}
            for w in workers:
                if w.url not in tasks:
                    tasks[w.url] = asyncio.create_task(call(session, w, timeout_s))
            return tasks

        async def health_loop() -> None:
            probes: dict[str, asyncio.Task] = {}
            while not self._stopping.is_set():
                self.changed.clear()
                probes = each(probes, self.all(), self._probe)
                await pause(self.changed, health_interval_s)
            await asyncio.gather(*probes.values())  # finished, not cancelled: see stop()

        async def load_loop() -> None:
            polls: dict[str, asyncio.Task] = {}
            while not self._stopping.is_set():
                polls = each(polls, [w for w in self.all() if w.healthy], self._poll_load)
                await pause(self._stopping, load_interval_s)
            await asyncio.gather(*polls.values())

        await asyncio.gather(health_loop(), load_loop())
