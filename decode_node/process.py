"""The decode's part of its scheduler process (``common.node.process.NodeProcess`` is the rest).

What differs from the prefill: its KV manager receives (``DecodeKVManager``); it has request rows
beyond ``max_running_requests`` (``prealloc_rows``) so rooms can pre-allocate and transfer while
the running batch is full, one aux row per request row, a prefix cache only when asked for
(``--disaggregation-decode-enable-radix-cache``: finished requests' pages serve the next turn of
a conversation; docs/ARCHITECTURE.md, "Decode node"), and its scheduler is ``DecodeScheduler`` with its
memory budget. With its prefix cache on, the cache publishes KV events as the prefill's does
(``common/node/kv_events.py``; flushed after every loop turn by ``DecodeStats.observe_step``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from common import envs
from common.config import CacheConfig, KVEventsConfig, SchedulerConfig, TransferConfig
from common.node.kv_events import publisher_info, start_publisher

# The scheduler's side (torch, the model) is imported in the build_* methods only: the API process
# builds this part and pickles it to the spawned ranks, and need not import torch for that.
if TYPE_CHECKING:
    from decode_node.scheduler import DecodeScheduler
    from decode_node.stats import DecodeStats
    from common.engine.driver import EngineDriver
    from common.node.tp_step import RankAgreement
    from common.engine.model_runner import ModelRunner
    from common.grammar.cache import GrammarCache
    from common.kvcache.kv_event_log import KVEventPublisher
    from common.sched.stop import StopChecker
    from transfer.aux import AuxPool
    from transfer.decode import DecodeKVManager


@dataclass
class DecodePart:
    sched: SchedulerConfig
    transfer: TransferConfig
    max_running_requests: int  # the node's --max-running-requests (CacheConfig's)
    role: str = "decode"
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # published only with the prefix cache on

    @property
    def rows(self) -> int:
        """Request rows: the running batch plus the rows rooms use while they pre-allocate,
        transfer and wait (``prealloc_rows``, by default as many as the running batch)."""
        prealloc = self.sched.prealloc_rows
        return self.max_running_requests + (self.max_running_requests if prealloc is None else prealloc)

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        assert cache.max_running_requests == self.max_running_requests, "the part was built from another config"
        # The prefix cache only with --disaggregation-decode-enable-radix-cache (decode_node.__main__).
        return replace(cache, max_running_requests=self.rows)

    def build_transfer(self, runner: ModelRunner, host: str) -> DecodeKVManager:
        from transfer.aux import AuxPool
        from transfer.factory import build_decode_manager, node_kv_args

        self._host = host  # the KV-event socket binds it too (build_scheduler)
        self._aux: AuxPool = AuxPool(self.rows, top_k=self.transfer.aux_top_k)
        # Where slices from a prefill of another TP size land before they are copied into the
        # room's pages; a room that does not fit fails at once (503, the router retries).
        staging = runner.kv_pool.num_pages // 4 if self.transfer.staging_pages is None else self.transfer.staging_pages
        args = node_kv_args(runner.kv_pool, runner.state_pool, self._aux, host, runner.tp.rank, runner.tp.size,
                            total_kv_heads=runner.arch.num_kv_heads, staging_pages=staging)
        return build_decode_manager(self.transfer, args)

    def build_scheduler(self, runner: ModelRunner, engine: EngineDriver, stop: StopChecker,
                        manager: DecodeKVManager, agreement: RankAgreement,
                        grammars: GrammarCache | None = None) -> tuple[DecodeScheduler, DecodeStats]:
        from decode_node.admission import DecodeBudget, DecodeBudgetConfig, NewTokenRatio
        from decode_node.scheduler import DecodeSchedConfig, DecodeScheduler
        from decode_node.stats import DecodeStats

        s, memory = self.sched, runner.memory
        if self.transfer.backend != "fake" and envs.KV_INTEGRITY.get():  # the fake backend moves no bytes
            from common.engine.model_runner import page_digests

            memory.digests = page_digests(runner, self.transfer.cluster_secret)
            # TP: a cached page changed on any rank is changed on all (the MIN of the ranks' first
            # bad page), so every rank locks the same prefix and their pools stay in step.
            memory.digests.agree_min = agreement.agree_min_int
        bcfg = DecodeBudgetConfig.from_sched(s, memory.page_size, memory.allocator.num_total)
        chunk = s.chunked_prefill_size if s.chunked_prefill_size > 0 else s.max_prefill_tokens
        from transfer.agreed import agreed_manager

        rooms = agreed_manager(manager, agreement)  # TP: handles whose states every rank reads the same
        scheduler = DecodeScheduler(
            engine, memory, rooms, self._aux, stop, DecodeBudget(bcfg),
            NewTokenRatio(bcfg.ratio_init, bcfg.ratio_min, bcfg.ratio_decay_steps),
            DecodeSchedConfig(max_running_requests=self.max_running_requests, recompute_tokens_per_step=chunk,
                              check_aux_room=self.transfer.backend != "fake", stream_interval=s.stream_interval,
                              fault_step_delay_s=envs.FAULT_DECODE_STEP_DELAY_S.get()),
            agree_all=agreement.agree_all, grammars=grammars)
        lay = runner.kv_pool.layout
        page_nbytes = 2 * lay.num_layers * lay.bytes_per_page_per_layer  # K and V of every layer
        self._events: KVEventPublisher | None = start_publisher(self.kv_events, self.role, runner, self._host,
                                                                self.transfer.cluster_secret)
        return scheduler, DecodeStats(scheduler, self._aux.num_slots, rooms.num_rooms, page_nbytes=page_nbytes,
                                      kv_events=self._events.log if self._events else None)

    def ready_info(self) -> dict:
        return {"running_rows": self.max_running_requests, "prealloc_rows": self.rows - self.max_running_requests,
                **publisher_info(self._events)}

    def close(self) -> None:
        if getattr(self, "_events", None) is not None:
            self._events.close()
