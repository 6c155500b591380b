"""The prefill node's scheduler process: model runner + KV sender side + the loop driving ``PrefillScheduler``.

::

    NodeIO.recv (GenerateReq / AbortReq; load/memory/metrics queries answered inside)
      -> PrefillScheduler.step(items) -> NodeIO.send(replies)          (repeat)

The loop never blocks on the network: transfers run on the ``PrefillKVManager``'s threads and
``sender.poll`` is a dict read. It waits on its socket only when no forward can run, and a
transfer thread wakes it as soon as a room's state changes (a TransferInfo arrived, a write
finished or failed). It exits
on SIGTERM/SIGINT, when ``stop`` is set, or when the process that started it (the node's API
process) is gone, so a killed node leaves no orphan scheduler behind.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from common import envs
from common.config import NodeConfig
from common.ipc.protocol import IpcEndpoints
from common.ipc.node_io import NodeIO
from common.server.node_launch import advertise_host, run_scheduler_process
from prefill_node.adder import PrefillBudget
from prefill_node.scheduler import PrefillSchedConfig, PrefillScheduler
from prefill_node.stats import PrefillStats

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Rooms in flight but nothing to compute: the transfer threads wake the loop when a room's state
# changes (NodeIO.wake), so this is only a backstop for the scheduler's own timeouts.
BUSY_WAIT_S = 0.02
IDLE_WAIT_S = 0.05  # nothing in flight: wake this often to notice a vanished parent


class PrefillProcess:
    """Everything the scheduler process owns; ``close`` releases it (transfer threads, engine, sockets)."""

    def __init__(self, cfg: NodeConfig, endpoints: IpcEndpoints, bootstrap_url: str) -> None:
        from common.engine.model_runner import ModelRunner
        from common.tokenizer import Tokenizer
        from transfer import AuxPool, HttpBootstrapClient, KVArgs, KVManagerConfig, PrefillKVManager, create_data_plane

        self.runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
        tokenizer = Tokenizer(cfg.model.tokenizer_path or cfg.model.model_path)
        # The transfer workers stage each aux record in rows of their own; this one-row pool
        # only gives the layout (row size) that the decode's aux rows must match.
        aux_layout = AuxPool(1, top_k=cfg.transfer.aux_top_k)
        host = advertise_host(cfg.server.host)
        states = self.runner.state_pool  # hybrid models: per-request recurrent state, sent with the KV
        args = KVArgs(layout=self.runner.kv_pool.layout, kv=KVArgs.kv_from_pool(self.runner.kv_pool),
                      state=KVArgs.state_from_pool(states), state_layout=None if states is None else states.layout,
                      aux=aux_layout.buffers(), aux_top_k=cfg.transfer.aux_top_k, host=host)
        self._aux_layout = aux_layout  # registered memory: keep it alive as long as the manager
        data_plane = create_data_plane(cfg.transfer.backend, host=host, protocol=envs.MOONCAKE_PROTOCOL.get(),
                                       device=envs.MOONCAKE_DEVICE.get(), transfer_timeout_s=cfg.transfer.write_timeout_s)
        try:  # the manager owns the data plane only once it is constructed
            self.manager = PrefillKVManager(args, data_plane, HttpBootstrapClient(), bootstrap_url,
                                            KVManagerConfig.from_transfer_config(cfg.transfer))
        except BaseException:
            data_plane.close()
            raise
        try:
            self._build_loop(cfg, endpoints, tokenizer)
        except BaseException:  # deregister the rank, stop the transfer threads, close the data plane
            self.manager.close()
            raise

    def _build_loop(self, cfg: NodeConfig, endpoints: IpcEndpoints, tokenizer: Tokenizer) -> None:
        from common.engine.driver import EngineDriver
        from common.engine.sampler import Sampler
        from common.sched.stop import StopChecker

        sched_cfg = PrefillSchedConfig(
            budget=PrefillBudget.from_flags(cfg.sched.max_prefill_tokens, cfg.sched.chunked_prefill_size),
            policy=cfg.sched.schedule_policy,
            transfer_timeout_s=cfg.transfer.waiting_timeout_s,
            aux_top_k=cfg.transfer.aux_top_k,
            context_len=self.runner.context_length,
        )
        self.scheduler = PrefillScheduler(EngineDriver(self.runner, Sampler()), self.runner.memory,
                                          self.manager.create_sender,
                                          StopChecker(tokenizer.eos_token_ids, tokenizer.decode), sched_cfg)
        self.stats = PrefillStats(self.scheduler, self.manager.num_rooms)
        self.io = NodeIO(endpoints, self.stats)
        self.manager.set_state_listener(self.io.wake)
        mem = self.runner.memory
        log.info("prefill scheduler ready: %d pages x %d tokens, %d request rows, backend %s, control %s",
                 mem.allocator.num_total, mem.page_size, mem.req_to_token.max_reqs, cfg.transfer.backend,
                 self.manager.endpoint)

    def serve(self, stop: threading.Event) -> None:
        sched, io = self.scheduler, self.io
        parent = os.getppid()
        next_check = time.monotonic() + 1.0
        while not stop.is_set():
            wait = 0.0 if sched.runnable() else IDLE_WAIT_S if sched.idle() else BUSY_WAIT_S
            items = io.recv(wait)
            try:
                outputs = sched.step(items)
            except Exception as exc:  # a scheduler bug fails the requests in flight, not the node
                log.exception("prefill step failed; failing every request in flight")
                try:
                    outputs = sched.fail_all(f"internal error in the prefill scheduler: {type(exc).__name__}: {exc}")
                except Exception:  # never out of the loop: that would take the node down
                    log.exception("failing the requests in flight failed too; their transfer timeouts end them")
                    outputs = []
            self.stats.observe_step()
            io.send(outputs)
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 1.0
                if os.getppid() != parent:
                    log.error("the prefill node's API process is gone; the scheduler exits")
                    return

    def ready_info(self) -> dict:
        return {"control_endpoint": self.manager.endpoint,
                "max_total_tokens": self.runner.memory.allocator.num_total * self.runner.memory.page_size}

    def close(self) -> None:
        self.manager.close()
        self.io.close()


def run_scheduler(cfg: NodeConfig, endpoints: IpcEndpoints, bootstrap_url: str,
                  ready: Connection | None = None) -> None:
    """Entry point of the scheduler process (a ``multiprocessing`` spawn target).

    Sends ``("ready", info)`` on ``ready`` once the model is loaded and the rank registered with
    the bootstrap server, or ``("error", message)`` if start-up failed.
    """
    run_scheduler_process("prefill-sched", lambda: PrefillProcess(cfg, endpoints, bootstrap_url), ready, cfg.cpu)
