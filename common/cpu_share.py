"""Co-located nodes share a host's cores: a decode step borrows what an idle neighbour lends.

Why. ``pdcluster up`` on C cores gives a prefill and a decode node C/2 torch threads each (see
common/cpu_budget.py). Under a steady decode load that leaves the prefill's cores idle between
prompts: on SmolLM2-135M's shape, 16 streams, the decode scheduler used 230 CPU-s of a 236 s run
while the prefill used 36. A decode step over 16-32 rows runs 1.3-1.6x faster on two threads than
on one, but a decode given both cores for good lost: whenever the prefill ran, two OpenMP pools
fought over one core (a team waits at every barrier for its descheduled thread). So the decode
sizes its pool per step to the cores nobody else is using *right now*.

The board. One file per share group in ``PDC_CPU_SHARE_DIR`` (default /dev/shm), mapped by every
node of the group: 64 slots of four int32, ``[threads in a forward now, pid, role, 0]``. A node
takes a free slot at start and holds an open-file-description write lock over the slot's bytes
for its life. The kernel drops that lock when the process dies, however it dies: a slot whose lock
is free belongs to nobody, its claim is void, and a starting node may take it. Reads and writes of
the claims take no lock (aligned 4-byte loads and stores): a stale read costs one step at the
wrong thread count, nothing else.

The protocol.
- Every node writes its thread count into its slot for the length of each forward, 0 after.
- A borrower (the decode role, when its projections are packed: see ``open_board``) before each
  forward takes ``max(base, cores - neighbours' claims)``
  threads, ``cores`` being the cores it may run on, and resizes torch's pool when that changes
  (``torch.set_num_threads``: under a microsecond, the pool's threads are kept).
- A lender (the prefill role) keeps its base count. A prefill forward runs for seconds and a decode
  step for tens of milliseconds: only the short step adapts; had the prefill borrowed, a decode
  arriving during its forward would be stuck beside it for the whole forward.
- A lender about to start a forward while a neighbour holds more threads than the cores leave it
  (a borrowed step in flight) writes its claim, then waits for that step to end (at most
  LENDER_WAIT_S): the borrower's next step sees the claim and runs at its base. Starting at once
  would put two OpenMP teams on one core for the rest of the borrowed step, whose threads then
  wait at every barrier for the descheduled one: on SmolLM2's shape under Poisson arrivals that
  overlap took the decode's TPOT p99 to 116-142 ms, against 51-103 ms without it (BENCHMARKS,
  "Borrowing without overlap").
Two borrowers (2 decodes on one host) each see the other's claim while their steps overlap and
fall back to their base; steps that do not overlap each get every core.

Off unless a node is given a group (``--cpu-share``); ``pdcluster up`` and ``bench --launch`` give
their nodes one when they divide the cores. Off on CUDA and under tensor parallelism.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

SLOTS = 64
# A lender waits this long at most for a borrowed step to end (a decode step is 2-50 ms; a long
# recompute with borrowed threads is not waited out), polling every LENDER_POLL_S.
LENDER_WAIT_S = 0.1
LENDER_POLL_S = 0.0005
_INTS = 4  # per slot: claim, pid, role, reserved
_SLOT_BYTES = _INTS * 4
_CLAIM, _PID, _ROLE = 0, 1, 2
_ROLES = {"prefill": 1, "decode": 2}
# struct flock on Linux (x86-64, aarch64): l_type, l_whence, l_start, l_len, l_pid, padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")
_GROUP = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class CoreShareError(ValueError):
    """A share group this host cannot open (bad name, no room on the board, no OFD locks)."""


def check_group(name: str) -> str:
    if not _GROUP.fullmatch(name):
        raise CoreShareError(f"--cpu-share {name!r}: a group name is 1-64 of A-Z a-z 0-9 _ . -")
    return name


def board_path(group: str, directory: str | None = None) -> str:
    from common import envs

    directory = directory or envs.CPU_SHARE_DIR.get() or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    return os.path.join(directory, f"pdcluster-cpu-{check_group(group)}")


class CoreBoard:
    """One node's place on its group's board. ``forward()`` wraps each model forward."""

    def __init__(self, path: str, *, role: str, threads: int, cores: int, borrow: bool,
                 set_threads=None) -> None:
        if threads < 1 or cores < threads:
            raise CoreShareError(f"a node on the core board needs 1 <= threads ({threads}) <= cores ({cores})")
        self.path, self.role, self.threads, self.cores, self.borrow = path, role, threads, cores, borrow
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._current = threads  # what the pool holds now (apply_scheduler_budget set the base)
        self.borrowed_steps = 0  # forwards run with more threads than the base
        self.waits, self.wait_seconds = 0, 0.0  # a lender's waits for a borrowed step to end
        self.forwards: dict[int, list[float]] = {}  # thread count -> [forwards, seconds]
        size = SLOTS * _SLOT_BYTES
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # two nodes starting together size the file once
            try:
                if os.fstat(self._fd).st_size < size:
                    os.ftruncate(self._fd, size)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(self._fd, size)
            self._ints = memoryview(self._map).cast("i")
            self.slot = self._take_slot()
        except BaseException:
            self._release_map()
            os.close(self._fd)
            raise
        base = self.slot * _INTS
        self._ints[base + _CLAIM] = 0
        self._ints[base + _PID] = os.getpid()
        self._ints[base + _ROLE] = _ROLES.get(role, 0)
        self._closed = False

    # -- locks ------------------------------------------------------------------------------------------
    def _lock(self, cmd: int, kind: int, slot: int) -> int:
        """fcntl(F_OFD_*) on the slot's bytes; returns the l_type the kernel hands back."""
        arg = _FLOCK.pack(kind, os.SEEK_SET, slot * _SLOT_BYTES, _SLOT_BYTES, 0)
        return _FLOCK.unpack(fcntl.fcntl(self._fd, cmd, arg))[0]

    def _take_slot(self) -> int:
        for slot in range(SLOTS):
            try:
                self._lock(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, slot)
            except BlockingIOError:
                continue  # a live node holds it
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):  # held by a live process
                    continue
                raise CoreShareError(f"core board {self.path}: open-file-description locks failed ({exc})") from exc
            return slot
        raise CoreShareError(f"core board {self.path}: all {SLOTS} slots are held by live nodes")

    def _alive(self, slot: int) -> bool:
        """Does a live process hold this slot? (Its lock is the proof; a pid could be reused.)"""
        return self._lock(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, slot) != fcntl.F_UNLCK

    # -- the protocol -----------------------------------------------------------------------------------
    def neighbours_threads(self) -> int:
        """Threads the group's other live nodes are running a forward with now."""
        total = 0
        ints = self._ints
        for slot in range(SLOTS):
            if slot == self.slot:
                continue
            claim = ints[slot * _INTS + _CLAIM]
            if claim > 0 and self._alive(slot):
                total += claim
        return total

    def plan(self) -> int:
        """Threads for the next forward."""
        if not self.borrow:
            return self.threads
        return max(self.threads, min(self.cores, self.cores - self.neighbours_threads()))

    @contextmanager
    def forward(self) -> Iterator[int]:
        n = self.plan()
        if n != self._current:
            self._set_threads(n)
            self._current = n
        if n > self.threads:
            self.borrowed_steps += 1
        claim = self.slot * _INTS + _CLAIM
        self._ints[claim] = n
        if not self.borrow:
            self._wait_for_borrowed_step(n)
        t0 = time.perf_counter()
        try:
            yield n
        finally:
            self._ints[claim] = 0
            tally = self.forwards.setdefault(n, [0, 0.0])
            tally[0] += 1
            tally[1] += time.perf_counter() - t0

    def _wait_for_borrowed_step(self, n: int) -> None:
        """A lender, its claim written: wait (bounded) until the neighbours' threads and ours fit
        the cores, i.e. a borrowed step in flight has ended (module docstring)."""
        if self.neighbours_threads() + n <= self.cores:
            return
        t0 = time.monotonic()
        deadline = t0 + LENDER_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(LENDER_POLL_S)
            if self.neighbours_threads() + n <= self.cores:
                break
        self.waits += 1
        self.wait_seconds += time.monotonic() - t0

    def as_dict(self) -> dict:
        return {"board": self.path, "slot": self.slot, "base_threads": self.threads, "cores": self.cores,
                "borrow": self.borrow}

    def summary(self) -> str:
        text = ", ".join(f"{n} thread(s): {int(c)} forwards, {sec:.1f} s" for n, (c, sec) in sorted(self.forwards.items()))
        return text + (f"; waited {self.waits} times for a borrowed step, {self.wait_seconds:.2f} s" if self.waits else "")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.forwards:
            log.info("core board %s: %s", self.path, self.summary())
        base = self.slot * _INTS
        self._ints[base + _CLAIM] = 0
        self._ints[base + _PID] = 0
        self._release_map()
        os.close(self._fd)  # drops the slot's lock

    def _release_map(self) -> None:
        ints = getattr(self, "_ints", None)
        if ints is not None:
            ints.release()
            self._ints = None  # type: ignore[assignment]
        mm = getattr(self, "_map", None)
        if mm is not None:
            mm.close()
            self._map = None  # type: ignore[assignment]


def open_board(group: str, *, role: str, threads: int, cores: int, device: str, tp_size: int,
               splits: bool = True) -> CoreBoard | None:
    """The node's board, or None where sharing does not apply (no group, a GPU, TP ranks); a
    board that cannot be opened is logged, never fatal: the node then runs at its base thread
    count, as without a group.

    ``splits``: whether this node's forward gains from more threads. A decode borrows only then;
    the node passes whether its projections are packed and a real model's
    (``ModelRunner.splits_well``, common/models/linear.py). MKL's few-row products barely split
    over two threads, and a tiny model's step is all per-op overhead: borrowing for it doubled the
    tiny model's TPOT (7-8 ms to 13-17 ms, BENCHMARKS), and with its projections packed for the
    whole-step kernel it still cost 15-40 % of its throughput at c=32.
    Such a node still claims its threads, so its neighbours see them."""
    if not group:
        return None
    if device != "cpu" or tp_size > 1:
        log.info("--cpu-share %s ignored: core sharing is for single-rank CPU nodes", group)
        return None
    try:
        board = CoreBoard(board_path(group), role=role, threads=threads, cores=max(cores, threads),
                          borrow=role == "decode" and splits)
    except (CoreShareError, OSError) as exc:
        log.warning("core sharing off: %s", exc)
        return None
    log.info("sharing %d cores with group %s (slot %d): %s", board.cores, group, board.slot,
             f"a step takes {threads}..{board.cores} threads" if board.borrow else f"forwards keep {threads} thread(s)")
    return board
