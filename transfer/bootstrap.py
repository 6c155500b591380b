"""The bootstrap registry as the managers use it: ``bootstrap_server.client`` with bound timeouts
and, when the cluster has one, its secret."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from bootstrap_server import client
from bootstrap_server.schema import PrefillLayout, RankInfo

from transfer.base import BootstrapClient
from transfer.errors import TransferError


@dataclass(frozen=True)
class HttpBootstrapClient:
    """Satisfies ``transfer.base.BootstrapClient``.

    ``lookup_timeout_s`` bounds one lookup including its retries of "not registered yet"; a lookup
    blocks only the decode's connect thread, and the answer is cached per prefill rank.
    """

    timeout_s: float = 5.0
    lookup_timeout_s: float = 5.0
    secret: str | None = field(default=None, repr=False)  # the cluster secret, sent on every call

    def with_secret(self, secret: str) -> HttpBootstrapClient:
        return replace(self, secret=secret)

    def register_rank(self, url: str, info: RankInfo) -> None:
        client.register_rank(url, info, timeout_s=self.timeout_s, secret=self.secret)

    def deregister_rank(self, url: str, info: RankInfo) -> None:
        client.deregister(url, info.engine_rank, info.dp_group, pp_rank=info.pp_rank,
                          instance_id=info.instance_id, timeout_s=min(self.timeout_s, 1.0), secret=self.secret)

    def lookup_layout(self, url: str) -> PrefillLayout:
        # complete: a decode picks its source ranks from the layout, so it waits for all of them
        return client.lookup_layout(url, timeout_s=self.lookup_timeout_s, secret=self.secret, complete=True)

    def lookup_rank(self, url: str, engine_rank: int, dp_group: int) -> RankInfo:
        return client.lookup_rank(url, engine_rank, dp_group, timeout_s=self.lookup_timeout_s, secret=self.secret)


def with_cluster_secret(bootstrap: BootstrapClient, secret: str | None) -> BootstrapClient:
    """``bootstrap`` presenting ``secret`` on every call (unchanged without one).

    The managers apply their config's secret here, so callers keep building a plain
    ``HttpBootstrapClient()``. A client that cannot carry a secret fails loudly rather than
    having every registry call refused later.
    """
    if secret is None:
        return bootstrap
    bind = getattr(bootstrap, "with_secret", None)
    if bind is None:
        raise TransferError(f"{type(bootstrap).__name__} cannot present the cluster secret (it has no with_secret)")
    return bind(secret)
