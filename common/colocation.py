"""Is another pdcluster node's scheduler already running on this process's cores?

A node launched with its per-role defaults sizes torch's pool to every core it may use: right for
one node per host, and several times too many threads when a prefill and a decode node share a
host (each spins its OpenMP threads against the other's). The default stays; this makes the wrong
case visible. The signal is cheap and read from /proc only: a pdcluster node's API process is one
whose command line runs ``pdcluster prefill|decode`` or ``-m prefill_node|decode_node``; its
scheduler is a child of that process (a multiprocessing spawn child, whose own command line names
nothing; of a node's children, the one with most OS threads is taken as its scheduler, the others
are helpers such as multiprocessing's resource tracker). A node whose scheduler's allowed cores
(``Cpus_allowed_list``) overlap ours, and that is not our own node, is a neighbour. The warning
fires when we take more threads than our cores minus one per neighbour: each other node keeps at
least one core busy, so ``pdcluster up`` splitting 2 cores between 2 nodes (1 thread each) stays
quiet while a node left at its default (every core) next to another is flagged. It is a floor, not
an exact count: a neighbour's torch threads cannot be read from /proc. Processes that vanish or
cannot be read mid-scan are skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_ROLES = ("prefill", "decode")
_MODULES = ("prefill_node", "decode_node")


@dataclass(frozen=True)
class Neighbour:
    pid: int  # the other node's scheduler process
    node_pid: int  # its API process (the one whose command line names the role)
    role: str
    cores: tuple[int, ...]  # the cores it may run on that we may run on too
    threads: int  # its OS threads (torch's pool among them)


def node_role(argv: list[str]) -> str | None:
    """The role if ``argv`` starts a pdcluster node's API process, else None."""
    for i, arg in enumerate(argv):
        base = os.path.basename(arg)
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if base == "pdcluster" and nxt in _ROLES:
            return nxt
        if arg == "-m" and nxt in _MODULES:
            return nxt.removesuffix("_node")
    return None


def _parse_cores(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _status(proc: Path, pid: int) -> dict[str, str]:
    fields = {}
    for line in (proc / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def busy_neighbours(my_cores: set[int], *, proc: Path = Path("/proc"), self_pid: int | None = None) -> list[Neighbour]:
    """Other nodes' schedulers whose allowed cores overlap ``my_cores``.

    ``self_pid`` is this scheduler (default: this process); it, its parent (our API process) and
    the parent's other children are our own node and never reported.
    """
    self_pid = os.getpid() if self_pid is None else self_pid
    try:
        my_parent = int(_status(proc, self_pid)["PPid"])
    except (OSError, KeyError, ValueError):
        my_parent = -1
    nodes: dict[int, str] = {}  # API pid -> role
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = [a for a in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0") if a]
            parents[pid] = int(_status(proc, pid)["PPid"])
        except (OSError, KeyError, ValueError):
            continue  # gone, or not ours to read
        role = node_role(argv)
        if role is not None:
            nodes[pid] = role
    best: dict[int, Neighbour] = {}  # node pid -> its child with most threads (its scheduler)
    for pid, ppid in sorted(parents.items()):
        if ppid not in nodes or ppid in (my_parent, self_pid) or pid == self_pid:
            continue
        try:
            st = _status(proc, pid)
            shared = _parse_cores(st["Cpus_allowed_list"]) & my_cores
            threads = int(st.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
        if ppid not in best or threads > best[ppid].threads:
            best[ppid] = Neighbour(pid, ppid, nodes[ppid], tuple(sorted(shared)), threads)
    return [n for _, n in sorted(best.items()) if n.cores]


def warning_text(neighbours: list[Neighbour], my_threads: int, my_cores: int) -> str | None:
    """The start-up warning, or None when our ``my_threads`` fit in our ``my_cores`` cores once
    each neighbour has one (see the module docstring)."""
    if not neighbours or my_threads <= my_cores - len(neighbours):
        return None
    who = "; ".join(f"{n.role} node pid {n.node_pid} (scheduler {n.pid}, {n.threads} threads) on cores "
                    f"{','.join(map(str, n.cores))}" for n in neighbours)
    return (f"this node's {my_threads} torch threads share cores with another pdcluster node: {who}. "
            "Nodes co-located on one host oversubscribe the cores; give each node its share with "
            "--cpu-threads N (and --cpu-bind to pin), see docs/OPERATIONS.md 'Co-located nodes'")
