"""The transfer managers' slice of configuration (built from ``common.config.TransferConfig``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.config import TransferConfig


# Not a setting: how often the background loops wake to check their timers and close().
TICK_S = 0.05


@dataclass(frozen=True)
class KVManagerConfig:
    """A view of ``TransferConfig``: every field but ``tick_s`` is one of its settings, built by
    ``from_transfer_config`` (``defaults(**overrides)``: the view of a default TransferConfig),
    so no default is declared twice (docs/OPERATIONS.md holds each one's meaning)."""

    bootstrap_timeout_s: float  # a room may stay Bootstrapping this long (both roles)
    waiting_timeout_s: float  # decode: TransferInfo sent -> KV landed
    heartbeat_interval_s: float  # decode -> prefill Ping period
    heartbeat_max_failures: int  # consecutive unanswered Pings before a prefill rank is dead
    num_workers: int  # prefill transfer worker threads
    max_batch_entries: int  # descriptors per peer per engine call
    # A dead-declared prefill whose control port still accepts connections may be hung, not gone:
    # its rooms are held (pages not reported free) this long before they fail.
    hung_peer_quarantine_s: float
    # The decode releases a fenced room's pages after this long even if its prefill was never
    # proven unable to write (0: never): a peer that never answers cannot hold memory forever.
    max_fence_s: float
    # Prefill: forget a decode's KV args and socket after this long without any message from it
    # (a live decode pings every heartbeat interval) while no room of ours is bound to it.
    idle_peer_purge_s: float
    # Seals and checks every control-plane message, and goes to the bootstrap registry, when set.
    cluster_secret: str | None = field(repr=False)
    tick_s: float = TICK_S

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s", "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVManagerConfig.{name} must be > 0")
        if self.heartbeat_max_failures < 1 or self.num_workers < 1 or self.max_batch_entries < 1:
            raise ValueError("KVManagerConfig: heartbeat_max_failures, num_workers, max_batch_entries must be >= 1")
        if self.hung_peer_quarantine_s < 0:
            raise ValueError("KVManagerConfig.hung_peer_quarantine_s must be >= 0")

    @property
    def heartbeat_bound_s(self) -> float:
        """Worst-case time from a prefill's death to its rooms failing on the decode."""
        return self.heartbeat_interval_s * (self.heartbeat_max_failures + 1)

    @classmethod
    def from_transfer_config(cls, tc: TransferConfig, **overrides: float | str | None) -> KVManagerConfig:
        values: dict[str, float | str | None] = dict(
            bootstrap_timeout_s=tc.bootstrap_timeout_s, waiting_timeout_s=tc.waiting_timeout_s,
            heartbeat_interval_s=tc.heartbeat_interval_s, heartbeat_max_failures=tc.heartbeat_max_failures,
            num_workers=tc.num_workers, max_batch_entries=tc.max_batch_entries,
            # Quarantine must outlast one blocked engine write, or a hung peer's write could land late.
            hung_peer_quarantine_s=max(tc.hung_peer_quarantine_s, tc.write_timeout_s),
            max_fence_s=tc.max_fence_s,
            idle_peer_purge_s=tc.idle_peer_purge_s, cluster_secret=tc.cluster_secret,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def defaults(cls, **overrides: float | str | None) -> KVManagerConfig:
        """The view of a default ``TransferConfig`` (its environment variables applied), with
        ``overrides``: for tools and tests that run managers without a node."""
        return cls.from_transfer_config(TransferConfig(), **overrides)  # type: ignore[arg-type]
