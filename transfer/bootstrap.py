"""The bootstrap registry as the managers use it: ``bootstrap_server.client`` with bound timeouts."""
from __future__ import annotations

from dataclasses import dataclass

from bootstrap_server import client
from bootstrap_server.schema import PrefillLayout, RankInfo


@dataclass(frozen=True)
class HttpBootstrapClient:
    """Satisfies ``transfer.base.BootstrapClient``.

    ``lookup_timeout_s`` bounds one lookup including its retries of "not registered yet"; a lookup
    blocks only the decode's connect thread, and the answer is cached per prefill rank.
    """

    timeout_s: float = 5.0
    lookup_timeout_s: float = 5.0

    def register_rank(self, url: str, info: RankInfo) -> None:
        client.register_rank(url, info, timeout_s=self.timeout_s)

    def deregister_rank(self, url: str, info: RankInfo) -> None:
        client.deregister(url, info.engine_rank, info.dp_group, pp_rank=info.pp_rank,
                          instance_id=info.instance_id, timeout_s=min(self.timeout_s, 1.0))

    def lookup_layout(self, url: str) -> PrefillLayout:
        return client.lookup_layout(url, timeout_s=self.lookup_timeout_s)

    def lookup_rank(self, url: str, engine_rank: int, dp_group: int) -> RankInfo:
        return client.lookup_rank(url, engine_rank, dp_group, timeout_s=self.lookup_timeout_s)
