"""The router's subscriptions to its nodes' KV events (common/kv_events.py), feeding the index the
exact cache-aware policies read (router/kv_index.py): the prefills', and the decodes' too when the
decode policy is exact (a decode publishes only with its prefix cache on).

    every 0.5 s: healthy workers of those roles (proven, not draining) without a subscription get one;
                 a subscription whose worker left rotation is cancelled and its index cleared
    one subscription:
        GET /server_info -> kv_events.endpoint (none: the node publishes nothing; look again later)
        SUB connect, then GET /kv_events/snapshot while the socket is read: batches that arrive
        meanwhile wait in the index and are applied after the snapshot (those it includes skipped)
        each frame: open (sealed with the cluster secret when there is one), decode, apply;
        a gap or a new instance -> snapshot again (the socket stays)
        no frame for ``stale_s`` (the node sends a heartbeat every second), a failed snapshot, a
        socket error -> index cleared (its worker is routed by load), start again after a pause

Nothing here can fail a client request: the policy reads only synced indexes and otherwise
routes by load. Every frame's verdict is counted (``pdc_router_kv_events_total``): malformed,
unauthenticated, replayed or out-of-order frames are dropped, never applied.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp
import zmq
import zmq.asyncio

from common.kv_events import MAX_FRAME_BYTES, EventCodec, KVSnapshot, Malformed, decode_snapshot
from router.kv_index import KVIndex, WorkerIndex
from router.workers import Workers

log = logging.getLogger("router.kv_events")

SCAN_S = 0.5  # how often the set of subscriptions follows the set of healthy workers
RETRY_S = 2.0  # pause before a failed subscription starts again
_RCVHWM = 100_000


class Silent(Exception):
    """No frame, not even a heartbeat, for ``stale_s``."""


class KVSubscriptions:
    def __init__(self, workers: Workers, index: KVIndex, session: aiohttp.ClientSession, secret: str | None,
                 stale_s: float, count: Callable[[str, str], None], timeout_s: float = 10.0,
                 roles: tuple[str, ...] = ("prefill",)) -> None:
        self._workers = workers
        self._roles = roles  # whose events the policies read
        self._index = index
        self._session = session
        self._secret = secret
        self._stale_s = stale_s
        self._count = count  # (worker url, verdict) -> the metric
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        try:
            while True:
                self.scan()
                await asyncio.sleep(SCAN_S)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._ctx.destroy(linger=0)

    def scan(self) -> None:
        want = {w.url for role in self._roles for w in self._workers.candidates(role)}
        for url in list(self._tasks):
            if url not in want or self._tasks[url].done():
                self._tasks.pop(url).cancel()
                self._index.forget(url)  # out of rotation: what it held no longer counts
        for url in want - set(self._tasks):
            self._tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-events {url}")

    # ---- one worker --------------------------------------------------------------------------

    async def _follow(self, url: str) -> None:
        idx = self._index.get(url)
        while True:
            try:
                endpoint = await self._endpoint(url)
                if endpoint is None:
                    self._count(url, "no_publisher")
                else:
                    await self._subscribe(url, endpoint, idx)
            except asyncio.CancelledError:
                raise
            except Silent:
                self._count(url, "silent")
                log.warning("KV events of %s: nothing heard for %g s; routing it by load until resynced",
                            url, self._stale_s)
            except Malformed as exc:
                self._count(url, "bad_snapshot")
                log.warning("KV events of %s: %s", url, exc)
            except (aiohttp.ClientError, TimeoutError, OSError, zmq.ZMQError, ValueError) as exc:
                self._count(url, "error")
                log.warning("KV events of %s: %s: %s", url, type(exc).__name__, exc)
            idx.clear()
            await asyncio.sleep(RETRY_S)

    async def _endpoint(self, url: str) -> str | None:
        async with self._session.get(url + "/server_info", timeout=self._timeout) as r:
            r.raise_for_status()
            info = await r.json(content_type=None)
        ev = info.get("kv_events") if isinstance(info, dict) else None
        endpoint = ev.get("endpoint") if isinstance(ev, dict) else None
        return endpoint if isinstance(endpoint, str) and endpoint.startswith("tcp://") else None

    async def _snapshot(self, url: str) -> KVSnapshot:
        async with self._session.get(url + "/kv_events/snapshot", timeout=self._timeout) as r:
            r.raise_for_status()
            return decode_snapshot(await r.read())

    async def _subscribe(self, url: str, endpoint: str, idx: WorkerIndex) -> None:
        codec = EventCodec(self._secret)  # one per socket: it remembers the nonces it opened
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        idx.clear()  # unsynced: batches wait for the snapshot
        recv = asyncio.ensure_future(sock.recv())
        snap: asyncio.Future | None = asyncio.ensure_future(self._snapshot(url))
        try:
            while True:
                waits = {recv} if snap is None else {recv, snap}
                done, _ = await asyncio.wait(waits, timeout=self._stale_s, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise Silent()
                if snap is not None and snap in done:
                    loaded = snap.result()
                    snap = None
                    for verdict in idx.load(loaded):
                        self._count(url, verdict)
                    self._count(url, "snapshot")
                    if not idx.synced:  # a batch that waited says the snapshot is already stale
                        snap = asyncio.ensure_future(self._snapshot(url))
                if recv in done:
                    frame = recv.result()
                    recv = asyncio.ensure_future(sock.recv())
                    try:
                        batch = codec.decode(frame)
                    except Malformed as exc:
                        self._count(url, exc.reason)
                        continue
                    verdict = idx.apply(batch)
                    self._count(url, verdict)
                    if verdict in ("gap", "restarted"):
                        log.info("KV events of %s: %s at seq %d; resyncing from the snapshot", url, verdict, batch.seq)
                        if snap is None:
                            snap = asyncio.ensure_future(self._snapshot(url))
        finally:
            for fut in (recv, snap):
                if fut is not None and not fut.done():
                    fut.cancel()
                    with contextlib.suppress(BaseException):
                        await fut
            sock.close(linger=0)
