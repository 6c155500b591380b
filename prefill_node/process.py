"""The prefill's part of its scheduler process (``common.node.process.NodeProcess`` is the rest).

What differs from the decode: its KV manager sends (``PrefillKVManager``, registered with the
node's own bootstrap server), its aux rows only give the layout the decode's rows must match (the
transfer workers stage each record in rows of their own), its scheduler is ``PrefillScheduler``,
and its prefix cache is on by default. The cache publishes KV events as the decode's does
(``common/node/kv_events.py``; flushed after every loop turn by ``PrefillStats.observe_step``, so
the scheduler's step is untouched).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common import envs
from common.config import CacheConfig, KVEventsConfig, SchedulerConfig, TransferConfig
from common.node.kv_events import publisher_info, start_publisher

# The scheduler's side (torch, the model) is imported in the build_* methods only: the API process
# builds this part and pickles it to the spawned ranks, and need not import torch for that.
if TYPE_CHECKING:
    from prefill_node.scheduler import PrefillScheduler
    from prefill_node.stats import PrefillStats
    from common.engine.driver import EngineDriver
    from common.node.tp_step import RankAgreement
    from common.engine.model_runner import ModelRunner
    from common.kvcache.kv_event_log import KVEventPublisher
    from common.grammar.cache import GrammarCache
    from common.sched.stop import StopChecker
    from transfer.aux import AuxPool
    from transfer.prefill import PrefillKVManager


# Per transfer worker: head slices for a decode of another TP size are gathered here; a larger
# chunk goes in pieces (transfer/staging.py). 64 pages of 16 tokens: a 1024-token piece.
PREFILL_STAGING_PAGES = 64


@dataclass
class PrefillPart:
    sched: SchedulerConfig
    transfer: TransferConfig
    bootstrap_url: str  # this node's bootstrap server, where the rank registers
    role: str = "prefill"
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        return cache

    def build_transfer(self, runner: ModelRunner, host: str) -> PrefillKVManager:
        from transfer.aux import AuxPool
        from transfer.factory import build_prefill_manager, node_kv_args

        self._host = host  # the KV-event socket binds it too (build_scheduler)
        # Registered memory: kept alive as long as the manager. One row: only its layout matters.
        self._aux: AuxPool = AuxPool(1, top_k=self.transfer.aux_top_k)
        staging = PREFILL_STAGING_PAGES if self.transfer.staging_pages is None else self.transfer.staging_pages
        args = node_kv_args(runner.kv_pool, runner.state_pool, self._aux, host, runner.tp.rank, runner.tp.size,
                            total_kv_heads=runner.arch.num_kv_heads, staging_pages=staging)
        self._manager = build_prefill_manager(self.transfer, args, self.bootstrap_url)
        return self._manager

    def build_scheduler(self, runner: ModelRunner, engine: EngineDriver, stop: StopChecker,
                        manager: PrefillKVManager, agreement: RankAgreement,
                        grammars: GrammarCache | None = None) -> tuple[PrefillScheduler, PrefillStats]:
        from prefill_node.admission import PrefillBudget
        from prefill_node.scheduler import PrefillSchedConfig, PrefillScheduler
        from prefill_node.stats import PrefillStats

        cfg = PrefillSchedConfig(
            budget=PrefillBudget.from_flags(self.sched.max_prefill_tokens, self.sched.chunked_prefill_size),
            policy=self.sched.schedule_policy,
            transfer_timeout_s=self.transfer.waiting_timeout_s,
            aux_top_k=self.transfer.aux_top_k,
            context_len=runner.context_length,
            ahead_pages=int(self.sched.compute_ahead_fraction * runner.memory.allocator.num_total),
        )
        from common.engine.model_runner import page_digests

        if envs.KV_INTEGRITY.get():  # checked before cache reuse, sent for the decode's check
            runner.memory.digests = page_digests(runner, self.transfer.cluster_secret)
            runner.memory.digests.agree_min = agreement.agree_min_int  # a page changed on any rank is changed
        from transfer.agreed import agreed_manager

        rooms = agreed_manager(manager, agreement)  # TP: handles whose states every rank reads the same
        scheduler = PrefillScheduler(engine, runner.memory, rooms.create_sender, stop, cfg, clock=agreement.clock,
                                     grammars=grammars)
        self._events = start_publisher(self.kv_events, self.role, runner, self._host, self.transfer.cluster_secret)
        return scheduler, PrefillStats(scheduler, rooms.num_rooms, self._events.log if self._events else None)

    def ready_info(self) -> dict:
        return {"control_endpoint": self._manager.endpoint, **publisher_info(self._events)}

    def close(self) -> None:
        if getattr(self, "_events", None) is not None:
            self._events.close()
