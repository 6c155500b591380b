"""How many CPU threads a node's model may use, and on which cores.

torch sizes its intra-op pool to every core of the machine. Two nodes on one host (a prefill and
a decode, plus their API processes) then each spin that many OpenMP threads against the other's:
on a 2-core box the cluster ran 4-12x slower than with one thread per scheduler. So:

    scheduler process   torch threads = --cpu-threads (or PDC_CPU_THREADS); 0/unset: the cores
                        this process may use (os.sched_getaffinity), or those of --cpu-bind, and
                        on a GPU node GPU_NODE_THREADS (below); --cpu-bind 0-3,8 also pins the
                        process (and so its threads) to those cores
    API process         one torch thread: it tokenizes and streams, it never runs the model
    launcher            `pdcluster up` / `bench --launch` divide the cores among the nodes they start

Threads started later by the process (transfer workers, ZMQ, Mooncake) run torch ops only on the
calling thread, so they take no intra-op threads of their own.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Torch threads of a GPU node's scheduler when none are asked for. Its model runs on the device;
# what torch runs on the host is a few small tensors a step (batch indices, page tables), where
# an OpenMP pool only adds fork/join and spinning. On an H200 host (16 cores) a decode node with a
# pool of 16 used 30-36 CPU seconds in a 4.5-s benchmark (docs/BENCHMARKS.md, "1 prefill + 1
# decode node on one GPU"): cores a co-located rank, the router or the transfer engine wanted.
# vLLM's GPU workers run one intra-op thread for the same reason.
GPU_NODE_THREADS = 1


class CpuBudgetError(ValueError):
    """A --cpu-threads / --cpu-bind value this machine cannot honour; the message names the flag."""


def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str, allowed: list[int] | None = None) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8); every core must be one this process may use."""
    allowed = allowed_cpus() if allowed is None else allowed
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError as exc:
            raise CpuBudgetError(f"--cpu-bind {text!r}: {part!r} is not a core number or a range like 0-3") from exc
        if a < 0 or b < a:
            raise CpuBudgetError(f"--cpu-bind {text!r}: {part!r} is not an ascending range of core numbers")
        cores += range(a, b + 1)
    if len(set(cores)) != len(cores):
        raise CpuBudgetError(f"--cpu-bind {text!r} names a core twice")
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise CpuBudgetError(f"--cpu-bind {text!r}: cores {outside} are not available to this process "
                             f"(available: {format_cpu_list(allowed)})")
    return tuple(cores)


def format_cpu_list(cores: list[int] | tuple[int, ...]) -> str:
    out, run = [], []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class CpuConfig:
    threads: int = 0  # torch intra-op threads of the scheduler process; 0: auto
    bind: tuple[int, ...] = ()  # cores to pin the scheduler process to; (): no pinning
    share: str = ""  # core-share group (common/cpu_share.py); "": off

    def validate(self) -> None:
        if self.threads < 0:
            raise CpuBudgetError(f"--cpu-threads must be >= 0 (0: auto), got {self.threads}")
        if self.bind and self.threads > len(self.bind):
            raise CpuBudgetError(f"--cpu-threads {self.threads} is more than the {len(self.bind)} cores of --cpu-bind")

    def resolved(self) -> CpuConfig:
        """``threads`` filled in: the bound cores, else every core this process may use."""
        self.validate()
        return CpuConfig(self.threads or len(self.bind or allowed_cpus()), self.bind, self.share)

    def cores(self) -> int:
        """The cores the scheduler may run on: the bound ones, else its affinity."""
        return len(self.bind or allowed_cpus())

    def as_dict(self) -> dict:
        return {"threads": self.threads, "bind": format_cpu_list(self.bind) if self.bind else None,
                "share": self.share or None}


def cpu_config(threads: int | None, bind: str | None, share: str | None = None, device: str = "cpu") -> CpuConfig:
    """From the flags, falling back to PDC_CPU_THREADS / PDC_CPU_BIND / PDC_CPU_SHARE; resolved and
    checked. ``device``: the node's resolved device; on a GPU unset threads are GPU_NODE_THREADS."""
    from common import envs
    from common.cpu_share import CoreShareError, check_group

    threads = envs.CPU_THREADS.get() if threads is None else threads
    bind = envs.CPU_BIND.get() if bind is None else bind
    share = envs.CPU_SHARE.get() if share is None else share
    if share:
        try:
            check_group(share)
        except CoreShareError as exc:
            raise CpuBudgetError(str(exc)) from exc
    if not threads and device.startswith("cuda"):
        threads = GPU_NODE_THREADS
    return CpuConfig(threads, parse_cpu_list(bind) if bind else (), share).resolved()



def apply_scheduler_budget(cfg: CpuConfig) -> None:
    """In the scheduler process, before the model loads: pin, size torch's pools, and keep the
    memory forwards free mapped (common/host_malloc.py)."""
    import torch

    from common import host_malloc

    if cfg.bind:
        os.sched_setaffinity(0, cfg.bind)
    torch.set_num_threads(cfg.threads)
    try:
        torch.set_num_interop_threads(1)  # the scheduler runs one op stream: no inter-op parallelism
    except RuntimeError:  # already set, or parallel work already ran: keep what is there
        pass
    log.info("scheduler CPU budget: %d torch threads%s", torch.get_num_threads(),
             f", pinned to cores {format_cpu_list(cfg.bind)}" if cfg.bind else "")
    malloc = host_malloc.tune()
    if malloc is not None:
        log.info("malloc: %s", ", ".join(f"{k} {v >> 20} MiB" for k, v in malloc.items()))
    warn_if_colocated(cfg.threads)


def warn_if_colocated(threads: int) -> None:
    """Log a warning when another pdcluster node's scheduler already runs on our cores (see
    common/colocation.py); a scan of /proc that fails never stops the node."""
    from common.colocation import busy_neighbours, warning_text

    try:
        cores = set(allowed_cpus())
        text = warning_text(busy_neighbours(cores), threads, len(cores))
    except OSError:
        return
    if text:
        log.warning("%s", text)


def limit_api_process() -> None:
    """The API process never runs the model: one torch thread, if torch is loaded at all."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def split_threads(n_nodes: int, cores: int | None = None) -> int:
    """Threads per node when ``n_nodes`` nodes share this host's cores (at least 1 each)."""
    cores = len(allowed_cpus()) if cores is None else cores
    return max(1, cores // max(1, n_nodes))
