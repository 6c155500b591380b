"""How the router authenticates itself to the nodes, and the nodes to it, without sending the
cluster secret anywhere (common/auth.py has the scheme).

    router -> node   every request but the health probe carries a fresh request token, added
                     by the session's client middleware (``sign_requests``): one place, so a new
                     call site cannot forget it
    node -> router   the health probe carries a challenge; only a node whose answer carries the
                     matching proof counts as healthy (``challenge_probe``), and only healthy
                     workers are sent anything that carries a token: a stranger's endpoint added
                     as a worker sees a challenge and nothing else

The probe itself carries no token (``/health`` is open on the nodes), so a worker that has not
proven the secret yet learns nothing from it.
"""
from __future__ import annotations

import aiohttp

from common.auth import AUTHORIZATION, PROOF_HEADER, RequestSigner, new_challenge, proof_matches

HEALTH_PATH = "/health"


class NotProven(Exception):
    """The worker answered the probe but did not prove the cluster secret."""


def sign_requests(secret: str):  # type: ignore[no-untyped-def]
    """aiohttp client middleware: a request token on every request but the health probe."""
    signer = RequestSigner(secret)

    async def middleware(req: aiohttp.ClientRequest, handler):  # type: ignore[no-untyped-def]
        if req.url.path != HEALTH_PATH:
            body = req.body if isinstance(req.body, bytes) else await req.body.as_bytes()
            req.headers[AUTHORIZATION] = signer.authorization(req.method, req.url.raw_path_qs, body)
        return await handler(req)

    return middleware


async def challenge_probe(session: aiohttp.ClientSession, url: str, secret: str | None,
                          timeout_s: float) -> str | None:
    """``GET url/health`` (with a challenge when the cluster has a secret): None when the worker is
    healthy, else why not; ``NotProven`` when it answered without proving the secret. Transport
    errors propagate."""
    challenge = new_challenge() if secret else None
    params = {"challenge": challenge} if challenge else None
    async with session.get(url + HEALTH_PATH, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        await r.read()
        if not 200 <= r.status < 300:
            return f"/health answered {r.status}"
        if secret and challenge and not proof_matches(secret, challenge, r.headers.get(PROOF_HEADER)):
            raise NotProven("/health did not prove the cluster secret (no or a wrong X-PDC-Proof): not a node of "
                            "this cluster, or another secret; nothing is sent to it")
    return None
