"""A node's scheduler process, both roles: one skeleton, plus the role part that differs.

::

    run_scheduler(part, cfg, endpoints, ready)          the spawn target (common.node.launch)
      size torch's thread pools (cpu budget), build NodeProcess, report ready/error, serve, close

    NodeProcess(cfg, part, endpoints)
      runner    = ModelRunner(model, part.cache_config(cache), attention)
      manager   = part.build_transfer(runner, host)     KV args + KV manager (transfer.factory)
      scheduler, stats = part.build_scheduler(runner, EngineDriver, StopChecker, manager)
      io        = NodeIO(endpoints, stats)               the manager's threads wake it
      serve():    io.recv -> scheduler.step(msgs) -> io.send      (common.node.contract)

Start-up failures release what was built: the factory closes the data plane if the manager
cannot start, and the manager (its threads, its rank's registration) is closed if anything after
it fails. The loop never blocks on the network: transfers run on the manager's threads and a
room's ``poll`` is a dict read. It waits on its socket only when no forward can run, and a
transfer thread wakes it as soon as a room's state changes. It exits on SIGTERM/SIGINT, when
``stop`` is set, or when the process that started it (the node's API process) is gone, so a
killed node leaves no orphan scheduler behind.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

import msgspec

from common import envs
from common.config import CacheConfig, GrammarConfig, NodeConfig
from common.cpu_budget import apply_scheduler_budget
from common.cpu_share import CoreBoard, open_board
from common.ipc.node_io import NodeIO, RankWaker, flush_cache
from common.ipc.protocol import AbortReq, FlushCacheReq, GenerateReq, IpcEndpoints, ReqOutput, WorkItem
from common.node.contract import NodeScheduler, StepStats
from common.node.tp_step import ONE_RANK, RankAgreement, StepClock, StepSync
from common.parallel import SINGLE_RANK, TPGroup, init_tp_group, rank_cpu_config

if TYPE_CHECKING:
    from common.engine.driver import EngineDriver
    from common.grammar.backend import GrammarBackend
    from common.tokenizer import Tokenizer
    from common.engine.model_runner import ModelRunner
    from common.grammar.cache import GrammarCache
    from common.sched.stop import StopChecker

log = logging.getLogger(__name__)

# Rooms in flight but nothing to compute: the transfer threads wake the loop when a room's state
# changes (NodeIO.wake), so this is only a backstop for the schedulers' own timers.
BUSY_WAIT_S = 0.02
IDLE_WAIT_S = 0.05  # nothing in flight: wake this often to notice a vanished parent
PARENT_CHECK_S = 1.0


class TransferManager(Protocol):
    """What the skeleton needs of a role's KV manager (``PrefillKVManager``, ``DecodeKVManager``)."""

    def set_state_listener(self, listener: Callable[[], None]) -> None: ...

    def num_rooms(self) -> int: ...

    def close(self) -> None: ...


class RolePart(Protocol):
    """What a role adds to the scheduler process. Built in the launcher from the role's slices of
    config and sent to the spawned process, so it must pickle (plain data until ``build_*``)."""

    role: str  # "prefill" | "decode"

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        """The KV cache this role needs (the decode adds request rows)."""
        ...

    def build_transfer(self, runner: ModelRunner, host: str) -> TransferManager:
        """Aux rows, KV args and the role's KV manager over ``runner``'s pools, reachable at ``host``."""
        ...

    def build_scheduler(self, runner: ModelRunner, engine: EngineDriver, stop: StopChecker,
                        manager: TransferManager, agreement: RankAgreement,
                        grammars: GrammarCache | None = None) -> tuple[NodeScheduler, StepStats]:
        """``agreement``: the clock the scheduler must read and how it agrees local verdicts
        with the node's other TP ranks (``ONE_RANK`` at tp = 1); the scheduler must get the
        manager through ``transfer.agreed.agreed_manager``. ``grammars``: the node's compile
        cache (None: structured outputs off)."""
        ...

    def ready_info(self) -> dict:
        """What the role adds to the "ready" report (after ``build_scheduler``)."""
        ...


class NodeProcess:
    """Everything one scheduler rank owns; ``close`` releases it (transfer threads, engine,
    sockets, its place in the TP group).

    With tp > 1 every rank builds the same: the model's shard, a KV pool of its own heads, its
    own KV manager (registered as its TP rank); only rank 0 is linked to the API (``io``), the
    others learn each step's input from it (``serve_ranks``). The scheduler's room handles,
    clock and local verdicts go through the step agreement (``common.node.tp_step``)."""

    def __init__(self, cfg: NodeConfig, part: RolePart, endpoints: IpcEndpoints, rank: int = 0,
                 group: TPGroup = SINGLE_RANK) -> None:
        from common.engine.driver import EngineDriver
        from common.engine.model_runner import ModelRunner
        from common.engine.sampler import Sampler
        from common.sched.stop import StopChecker
        from common.tokenizer import Tokenizer

        self.role, self.group = part.role, group
        self._part = part
        self.sync = StepSync(group)
        # A prefill node never runs a decode step: capturing decode graphs would only cost start-up time.
        attention = cfg.attention if part.role == "decode" else replace(cfg.attention, disable_cuda_graph=True)
        self.runner = ModelRunner(cfg.model, part.cache_config(cfg.cache), attention, tp=group)
        tokenizer = Tokenizer(cfg.model.tokenizer_path or cfg.model.model_path)
        self.manager = part.build_transfer(self.runner, advertise_host(cfg.server.host))
        self.io: NodeIO | None = None
        self._waker: RankWaker | None = None
        self.cores: CoreBoard | None = None
        try:
            backend, self.grammars = build_grammars(cfg.grammar, tokenizer, self.runner.arch.vocab_size)
            # The sampler masks ends before min_new_tokens and, with a backend, what grammars refuse.
            sampler = Sampler(eos_token_ids=tokenizer.eos_token_ids, grammar=backend)
            self.clock = StepClock()
            self.agreement = ONE_RANK if group.size == 1 else RankAgreement.of(self.sync, self.clock)
            if self.grammars is not None:  # TP: a grammar is ready (or failed) on every rank at once
                self.grammars.agree_min = self.agreement.agree_min_int
            self.cores = open_board(cfg.cpu.share, role=part.role, threads=cfg.cpu.threads, cores=cfg.cpu.cores(),
                                    device=str(self.runner.device), tp_size=group.size,
                                    splits=self.runner.splits_well)
            self.scheduler, self.stats = part.build_scheduler(
                self.runner, EngineDriver(self.runner, sampler, self.cores), StopChecker(tokenizer.eos_token_ids, tokenizer.decode),
                self.manager, self.agreement, self.grammars)
            if group.is_first:
                self.io = NodeIO(endpoints, self.stats, defer_flush=group.size > 1, rank_wakes=group.size > 1)
                wake = self.io.wake
            else:  # rank 0 paces the loop: this rank's rooms and grammars wake it from here
                self._waker = RankWaker(endpoints)
                wake = self._waker.wake
            self.manager.set_state_listener(wake)
            if self.grammars is not None:  # a finished compile wakes the loop like a finished transfer
                self.grammars.set_listener(wake)
        except BaseException:  # deregister the rank, stop the transfer threads, close the data plane
            self.manager.close()
            self._close_part()
            if self.cores is not None:
                self.cores.close()
            raise
        mem = self.runner.memory
        self._ready = {"max_total_tokens": mem.allocator.num_total * mem.page_size, **part.ready_info()}
        if self.cores is not None:
            self._ready["cpu_share"] = self.cores.as_dict()
        log.info("%s scheduler ready: %d pages x %d tokens, %d request rows, backend %s (%s)", self.role,
                 mem.allocator.num_total, mem.page_size, mem.req_to_token.max_reqs, cfg.transfer.backend,
                 ", ".join(f"{k} {v}" for k, v in self._ready.items()))

    def serve(self, stop: threading.Event) -> None:
        if self.group.size == 1:
            assert self.io is not None
            serve(self.scheduler, self.io, self.stats, stop, self.role)
        else:
            serve_ranks(self, stop)

    def ready_info(self) -> dict:
        return dict(self._ready)

    def close(self) -> None:
        self.manager.close()
        if self.io is not None:
            self.io.close()
        if self._waker is not None:
            self._waker.close()
        if self.grammars is not None:
            self.grammars.close()
        if self.cores is not None:
            self.cores.close()
        self._close_part()
        self.group.close()

    def _close_part(self) -> None:
        close_part = getattr(self._part, "close", None)  # what a role opened beside the manager
        if close_part is not None:
            close_part()


def build_grammars(cfg: GrammarConfig, tokenizer: Tokenizer, vocab_size: int) -> tuple[GrammarBackend | None, GrammarCache | None]:
    """The node's grammar backend over its own tokenizer (built once here) and its compile cache;
    (None, None) with ``--grammar-backend none``."""
    from common.grammar.factory import load_backend
    from common.grammar.cache import GrammarCache

    backend = load_backend(cfg.backend, tokenizer.backend_json(), vocab_size, sorted(tokenizer.eos_token_ids), cfg.threads)
    if backend is None:
        return None, None
    return backend, GrammarCache(backend, capacity=cfg.cache_size, threads=cfg.threads, timeout_s=cfg.compile_timeout_s)


class LoopIO(Protocol):
    def recv(self, timeout_s: float = 0.0) -> list[WorkItem]: ...

    def send(self, items: list[ReqOutput]) -> None: ...


def serve(sched: NodeScheduler, io: LoopIO, stats: StepStats, stop: threading.Event, role: str) -> None:
    """The node loop (see ``common.node.contract``) until ``stop`` is set or the parent is gone."""
    parent = os.getppid()
    next_check = time.monotonic() + PARENT_CHECK_S
    while not stop.is_set():
        t0 = time.perf_counter()
        runnable = sched.runnable()
        msgs = io.recv(0.0 if runnable else IDLE_WAIT_S if sched.idle() else BUSY_WAIT_S)
        if not runnable:
            t0 = time.perf_counter()  # waiting for input is idle time, not the step's
        try:
            outputs = sched.step(msgs)
        except Exception as exc:  # a scheduler bug fails the requests in flight, not the node
            log.exception("%s step failed; failing every request in flight", role)
            try:
                outputs = sched.fail_all(f"internal error in the {role} scheduler: {type(exc).__name__}: {exc}")
            except Exception:  # never out of the loop: that would take the node down
                log.exception("failing the requests in flight failed too; their own timeouts end them")
                outputs = []
        io.send(outputs)
        stats.observe_step(time.perf_counter() - t0)
        if time.monotonic() > next_check:
            next_check = time.monotonic() + PARENT_CHECK_S
            if os.getppid() != parent:
                log.error("the %s node's API process is gone; the scheduler exits", role)
                return


class _StepInput(msgspec.Struct, array_like=True):
    """What rank 0 broadcasts each step: stop the loop, flush the caches, the API's messages."""

    stop: bool
    flushes: list[FlushCacheReq]
    items: list[GenerateReq | AbortReq]


_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(_StepInput)


def serve_ranks(node: NodeProcess, stop: threading.Event) -> None:
    """The loop of a TP node's ranks (tp > 1): ``serve``'s, with the step agreement in front.

    Rank 0 reads the API link and decides when the loop ends (SIGTERM, its parent gone); it
    broadcasts each step's input and clock, then every rank agrees its rooms' states and runs
    the same step; only rank 0 sends the outputs. A rank whose step raises leaves the loop (the
    exception ends the process): the other ranks' next collective fails as its connections
    close, so the whole node goes down and its supervisor sees it, instead of ranks that
    disagree on what happened. Other ranks ignore their own SIGTERM: they end when rank 0 says
    so, or when rank 0 is gone (a failed collective)."""
    sched, io, sync, stats = node.scheduler, node.io, node.sync, node.stats
    first = node.group.is_first
    parent = os.getppid()
    next_check = time.monotonic() + PARENT_CHECK_S
    while True:
        t0 = time.perf_counter()
        encoded = clock = None
        if first:
            assert io is not None
            runnable = sched.runnable()
            items = io.recv(0.0 if runnable else IDLE_WAIT_S if sched.idle() else BUSY_WAIT_S)
            if not runnable:
                t0 = time.perf_counter()
            if time.monotonic() > next_check:
                next_check = time.monotonic() + PARENT_CHECK_S
                if os.getppid() != parent:
                    log.error("the %s node's API process is gone; the scheduler ranks exit", node.role)
                    stop.set()
            flushes, io.flushes = io.flushes, []
            encoded = _step_encoder.encode(_StepInput(stop.is_set(), flushes, list(items)))
            clock = time.monotonic()
        step = sync.inputs(encoded, clock)
        msg = _step_decoder.decode(step.encoded)
        if msg.stop:
            return
        node.clock.now = step.clock
        for hook in node.agreement.step_hooks:  # the role's room handles agree their states
            hook()
        for flush in msg.flushes:  # every rank flushes at the same step; rank 0 answers
            result = flush_cache(stats)
            if io is not None:
                io.reply_flush(flush.query_id, result)
        outputs = sched.step(msg.items)
        if io is not None:
            io.send(outputs)
        stats.observe_step(time.perf_counter() - t0)


def advertise_host(host: str) -> str:
    """The address peers should use to reach us: ``host`` unless it is a wildcard."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it picks the outgoing interface
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def freeze_startup_objects() -> int:
    """Collect start-up's garbage, then move every object left (modules, the model's modules,
    tokenizer tables) out of the cyclic collector's reach; returns how many were frozen.

    Why: a scheduler process tracks ~300k objects once its model is loaded (SmolLM2-135M's
    shape), and a full collection walks them all: ~145 ms on one Zen 4 core, during which the loop
    runs no step and every stream on the node stalls. Full collections are rare in steady state
    but follow bursts that leave survivors; frozen, they walk only what serving made since (0.0
    ms for the same process; docs/BENCHMARKS.md, "Short last tiles, a mirror resident only where
    written").
    What start-up made lives as long as the process, so nothing collectable is kept.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_scheduler(part: RolePart, cfg: NodeConfig, endpoints: IpcEndpoints, rank: int = 0, init_method: str = "",
                  ready: Connection | None = None) -> None:
    """Entry point of scheduler rank ``rank`` (a ``multiprocessing`` spawn target); with
    tp > 1 the ranks meet at ``init_method`` (rank 0 listens there).

    Sends ``("ready", info)`` on ``ready`` once the model is loaded and the transfer manager is up
    (a prefill rank registered with its bootstrap server), or ``("error", message)`` if start-up
    failed, so the launcher fails fast.
    """
    tp = cfg.parallel.tp_size
    tag = f"{part.role}-sched" + (f"-tp{rank}" if tp > 1 else "")
    logging.basicConfig(level=envs.LOG_LEVEL.get(), format=f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cpu = rank_cpu_config(cfg.cpu, rank, tp)
    group: TPGroup = SINGLE_RANK
    try:
        apply_scheduler_budget(cpu)  # before the model loads: torch's pools are sized once
        if tp > 1:
            group = init_tp_group(rank, tp, init_method, cfg.model.device, timeout_s=envs.TP_TIMEOUT_S.get())
        proc = NodeProcess(cfg, part, endpoints, rank, group)
    except Exception as exc:
        group.close()
        log.exception("%s failed to start", tag)
        if ready is not None:
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    try:
        frozen = freeze_startup_objects()
        if ready is not None:
            ready.send(("ready", {"pid": os.getpid(), "cpu": cpu.as_dict(), "gc_frozen_objects": frozen,
                                  **proc.ready_info()}))
            ready.close()
        proc.serve(stop)
    finally:
        proc.close()
