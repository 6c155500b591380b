"""The prefill's part of its scheduler process (``common.node.process.NodeProcess`` is the rest).

What differs from the decode: its KV manager sends (``PrefillKVManager``, registered with the
node's own bootstrap server), its aux rows only give the layout the decode's rows must match (the
transfer workers stage each record in rows of their own), and its scheduler is
``PrefillScheduler``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import envs
from common.config import CacheConfig, SchedulerConfig, TransferConfig
from prefill_node.adder import PrefillBudget
from prefill_node.scheduler import PrefillSchedConfig, PrefillScheduler
from prefill_node.stats import PrefillStats

if TYPE_CHECKING:
    from common.engine.driver import EngineDriver
    from common.engine.model_runner import ModelRunner
    from common.grammar.cache import GrammarCache
    from common.sched.stop import StopChecker
    from transfer.aux import AuxPool
    from transfer.prefill import PrefillKVManager


@dataclass
class PrefillPart:
    sched: SchedulerConfig
    transfer: TransferConfig
    bootstrap_url: str  # this node's bootstrap server, where the rank registers
    role: str = "prefill"

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        return cache

    def build_transfer(self, runner: ModelRunner, host: str) -> PrefillKVManager:
        from transfer.aux import AuxPool
        from transfer.factory import build_prefill_manager, node_kv_args

        # Registered memory: kept alive as long as the manager. One row: only its layout matters.
        self._aux: AuxPool = AuxPool(1, top_k=self.transfer.aux_top_k)
        self._manager = build_prefill_manager(self.transfer, node_kv_args(runner.kv_pool, runner.state_pool, self._aux, host),
                                              self.bootstrap_url)
        return self._manager

    def build_scheduler(self, runner: ModelRunner, engine: EngineDriver, stop: StopChecker,
                        manager: PrefillKVManager, grammars: GrammarCache | None = None) -> tuple[PrefillScheduler, PrefillStats]:
        cfg = PrefillSchedConfig(
            budget=PrefillBudget.from_flags(self.sched.max_prefill_tokens, self.sched.chunked_prefill_size),
            policy=self.sched.schedule_policy,
            transfer_timeout_s=self.transfer.waiting_timeout_s,
            aux_top_k=self.transfer.aux_top_k,
            context_len=runner.context_length,
        )
        from common.engine.model_runner import page_digests

        if envs.KV_INTEGRITY.get():  # checked before cache reuse, sent for the decode's check
            runner.memory.digests = page_digests(runner, self.transfer.cluster_secret)
        scheduler = PrefillScheduler(engine, runner.memory, manager.create_sender, stop, cfg, grammars=grammars)
        return scheduler, PrefillStats(scheduler, manager.num_rooms)

    def ready_info(self) -> dict:
        return {"control_endpoint": self._manager.endpoint}
