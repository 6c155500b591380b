"""The decode node's scheduler process: build the engine, the KV receiver side and the loop that drives
``DecodeScheduler`` from the API process's messages.

::

    NodeIO.recv (GenerateReq / AbortReq; queries answered inside)
      -> DecodeScheduler.step(msgs) -> NodeIO.send(outputs)        (repeat; never blocks long)

The loop waits for input only when no forward is pending: at most ``POLL_WAIT_S`` while rooms
are in flight, ``IDLE_WAIT_S`` when nothing is; a message, or a transfer thread reporting a
room's new state (KV arrived, a peer failed), wakes it at once either way. It exits when told to stop, on SIGTERM, or when the process
that started it (the node's API process) is gone, so a killed node leaves no orphan behind.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from common import envs
from common.config import NodeConfig
from common.ipc.protocol import IpcEndpoints
from decode_node.budget import DecodeBudget, DecodeBudgetConfig, NewTokenRatio
from common.ipc.node_io import NodeIO
from common.sched.stop import StopChecker
from common.server.node_launch import advertise_host, run_scheduler_process
from decode_node.scheduler import DecodeSchedConfig, DecodeScheduler
from decode_node.stats import DecodeStats

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Longest wait for input while rooms are in flight but nothing can run. The transfer threads
# wake the loop when a room's state changes (NodeIO.wake): this is a backstop for timers only.
POLL_WAIT_S = 0.02
IDLE_WAIT_S = 0.05  # nothing in flight at all: a message still wakes the loop at once


class DecodeProcess:
    """Everything the scheduler process owns; ``close`` releases it (manager threads, engine, sockets)."""

    def __init__(self, cfg: NodeConfig, endpoints: IpcEndpoints) -> None:
        from common.engine.model_runner import ModelRunner
        from common.tokenizer import Tokenizer
        from transfer import AuxPool, DecodeKVManager, HttpBootstrapClient, KVArgs, KVManagerConfig, create_data_plane

        max_running = cfg.cache.max_running_requests
        rows = max_running + (cfg.sched.prealloc_rows if cfg.sched.prealloc_rows is not None else max_running)
        # Received KV is never cached here (see docs/ARCHITECTURE.md, "Decode node").
        cache_cfg = replace(cfg.cache, max_running_requests=rows, enable_prefix_cache=False)
        self.runner = ModelRunner(cfg.model, cache_cfg, cfg.attention)
        tokenizer = Tokenizer(cfg.model.tokenizer_path or cfg.model.model_path)
        self.aux = AuxPool(rows, top_k=cfg.transfer.aux_top_k)
        host = advertise_host(cfg.server.host)
        states = self.runner.state_pool  # hybrid models: per-request recurrent state, sent with the KV
        args = KVArgs(layout=self.runner.kv_pool.layout, kv=KVArgs.kv_from_pool(self.runner.kv_pool),
                      state=KVArgs.state_from_pool(states), state_layout=None if states is None else states.layout,
                      aux=self.aux.buffers(), aux_top_k=cfg.transfer.aux_top_k, host=host)
        data_plane = create_data_plane(cfg.transfer.backend, host=host, protocol=envs.MOONCAKE_PROTOCOL.get(),
                                       device=envs.MOONCAKE_DEVICE.get())
        try:  # the manager owns the data plane only once it is constructed
            self.manager = DecodeKVManager(args, data_plane, HttpBootstrapClient(),
                                           KVManagerConfig.from_transfer_config(cfg.transfer))
        except BaseException:
            data_plane.close()
            raise
        try:
            self._build_loop(cfg, endpoints, tokenizer, max_running, rows)
        except BaseException:  # stop the transfer threads, close the data plane
            self.manager.close()
            raise

    def _build_loop(self, cfg: NodeConfig, endpoints: IpcEndpoints, tokenizer: Tokenizer,
                    max_running: int, rows: int) -> None:
        from common.engine.driver import EngineDriver
        from common.engine.sampler import Sampler

        memory = self.runner.memory
        bcfg = DecodeBudgetConfig(
            page_size=cfg.cache.page_size, total_pages=memory.allocator.num_total,
            reserved_decode_tokens=cfg.sched.reserved_decode_tokens, ratio_init=cfg.sched.new_token_ratio_init,
            ratio_min=min(cfg.sched.new_token_ratio_min, cfg.sched.new_token_ratio_init),
            ratio_decay_steps=cfg.sched.new_token_ratio_decay_steps)
        chunk = cfg.sched.chunked_prefill_size if cfg.sched.chunked_prefill_size > 0 else cfg.sched.max_prefill_tokens
        self.scheduler = DecodeScheduler(
            EngineDriver(self.runner, Sampler()), memory, self.manager, self.aux,
            StopChecker(tokenizer.eos_token_ids, tokenizer.decode), DecodeBudget(bcfg),
            NewTokenRatio(bcfg.ratio_init, bcfg.ratio_min, bcfg.ratio_decay_steps),
            DecodeSchedConfig(max_running_requests=max_running, recompute_tokens_per_step=chunk,
                              check_aux_room=cfg.transfer.backend != "fake"))
        self.stats = DecodeStats(self.scheduler, self.aux.num_slots, self.manager.num_rooms)
        self.io = NodeIO(endpoints, self.stats)
        self.manager.set_state_listener(self.io.wake)
        log.info("decode scheduler ready: %d pages x %d tokens, %d running + %d prealloc rows, backend %s, host %s",
                 bcfg.total_pages, bcfg.page_size, max_running, rows - max_running, cfg.transfer.backend,
                 self.manager.args.host)

    def serve(self, stop: threading.Event) -> None:
        sched, io = self.scheduler, self.io
        parent = os.getppid()
        next_check = time.monotonic() + 1.0
        while not stop.is_set():
            t0 = time.perf_counter()
            steps_before = sched.counters.decode_steps
            runnable = sched.runnable()
            msgs = io.recv(0.0 if runnable else IDLE_WAIT_S if sched.idle() else POLL_WAIT_S)
            if not runnable:
                t0 = time.perf_counter()  # waiting for input is idle time, not step overhead
            before = sched.counters.generated_tokens
            try:
                outputs = sched.step(msgs)
            except Exception as exc:  # a bug must fail the requests, not hang them or kill the node
                log.exception("decode step failed; failing every request in flight")
                try:
                    outputs = sched.fail_all(f"internal error in the decode scheduler: {type(exc).__name__}: {exc}")
                except Exception:  # never out of the loop: that would take the node down
                    log.exception("failing the requests in flight failed too")
                    outputs = []
            self.stats.throughput.add(sched.counters.generated_tokens - before)
            io.send(outputs)
            if sched.counters.decode_steps != steps_before:
                # The whole turn of a decode step (input, queues, forward, stop checks, output IPC):
                # minus decode_forward_seconds it is the per-step overhead `pdcluster bench` reports.
                sched.counters.decode_step_seconds += time.perf_counter() - t0
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 1.0
                if os.getppid() != parent:
                    log.error("the decode node's API process is gone; scheduler exits")
                    return

    def ready_info(self) -> dict:
        return {"max_total_tokens": self.stats.memory()["total_pages"] * self.runner.memory.page_size}

    def close(self) -> None:
        self.manager.close()
        self.io.close()


def run_scheduler(cfg: NodeConfig, endpoints: IpcEndpoints, ready: Connection) -> None:
    """Entry point of the scheduler process (``multiprocessing`` target). Reports ``("ready", info)``
    or ``("error", reason)`` on ``ready`` once start-up is over, so the launcher fails fast."""
    run_scheduler_process("decode-sched", lambda: DecodeProcess(cfg, endpoints), ready, cfg.cpu)
