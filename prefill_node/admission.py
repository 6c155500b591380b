"""Which prompts (and how much of each) go into one prefill forward: budgets and queue policy.

Plain data in, plain data out: the scheduler asks, the adder answers with token counts; it never
touches a pool. One adder lives for one step::

    adder = PrefillAdder(budget, available_pages=memory.available_pages(), page_size=ps)
    n = adder.add_chunked(remaining)            # the request already part-way through its prompt
    for req in order_waiting(waiting, policy, prefix_len):
        n = adder.add_new(prompt_len, cached_len, lock_pages)   # None: does not fit -> stop
        if adder.closed: break

Budgets (all must hold after every add):

* **tokens**: the batch computes at most ``max_prefill_tokens`` tokens. The first request of a
  batch is exempt when chunking is off: a prompt longer than the budget could never run
  otherwise (it is admitted alone).
* **chunk**: one request computes at most ``chunk_size`` tokens per forward. A new request that
  gets fewer tokens than it has left becomes *the* chunked request and closes the batch, so at
  most one request is ever part-way through its prompt (it continues first next step). While
  the chunked request goes on, new requests that fit *whole* join its slice: a short prompt
  (a chat's next turn, mostly cached) then waits one slice, not the whole long prompt::

      step 1: [ A (whole) | B (whole) | C[0:k] ]          C is chunked, batch closed
      step 2: [ C[k:2k] | D (whole) ]                      still chunked; only whole prompts join
      step 3: [ C[2k:] | E (whole) | F[0:j] ]              C done, F is chunked now

  A waiting prompt that would have to be cut while the chunked request goes on cannot start
  this step whatever comes after it (``waits_for_chunk``), so the prompts behind it are still
  offered, whole: without that, one long prompt waiting behind another held every short prompt
  behind both until the first finished (with 10 % 2048-token prompts among 128-token ones, short
  prompts' time to first token reached 13-18 s at 1.4 req/s; docs/BENCHMARKS.md, "Goodput under
  SLO on this machine"). It keeps its place: the step after the chunked request ends, it is
  first again.

* **KV pages**: a new request reserves the pages of its whole prompt at admission, minus the
  pages its cached prefix already provides (so a chunked request can never run out of memory
  half-way). ``available_pages`` is what the KV memory can hand out: free pages plus pages the
  prefix cache could evict. Pages held by in-flight transfers are neither (they belong to their
  requests until Success/Failed), so a node whose pool is tied up in transfers admits nothing
  new until they finish. Locking a cached prefix makes its pages unevictable: the caller passes
  how many pages that took out of ``available_pages`` (``lock_pages``) so the count stays exact.

SGLang differs in one point: its chunk budget is shared by the whole batch. Here
``max_prefill_tokens`` bounds the batch (activation memory, forward time) and ``chunk_size``
bounds one request's slice (how early its first pages start streaming to the decode).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

Policy = Literal["fcfs", "lpm"]

T = TypeVar("T")

# Longest-prefix-match needs one cache walk per waiting request; past this queue length the
# walks cost more than the ordering gains (SGLang uses the same cut-off) and FCFS is used.
LPM_MAX_QUEUE = 128


@dataclass(frozen=True)
class PrefillBudget:
    max_prefill_tokens: int
    chunk_size: int | None  # None: chunking off (a prompt runs in one forward)

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")

    @classmethod
    def from_flags(cls, max_prefill_tokens: int, chunked_prefill_size: int) -> PrefillBudget:
        """``--chunked-prefill-size <= 0`` turns chunking off, as in SGLang."""
        return cls(max_prefill_tokens, chunked_prefill_size if chunked_prefill_size > 0 else None)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PrefillAdder:
    def __init__(self, budget: PrefillBudget, available_pages: int, page_size: int) -> None:
        self.budget = budget
        self.page_size = page_size
        self.rem_tokens = budget.max_prefill_tokens
        self.rem_pages = available_pages
        self.num_reqs = 0
        self.batch_tokens = 0
        self.closed = False  # a new request was cut short (or the token budget is spent): add nothing more
        self.whole_only = False  # the chunked request goes on part-way: only whole prompts may join

    def _slice(self, remaining: int) -> int:
        """Tokens a request with ``remaining`` prompt tokens computes in this forward (0: none)."""
        if self.budget.chunk_size is not None:
            return max(0, min(remaining, self.budget.chunk_size, self.rem_tokens))
        if self.num_reqs == 0:
            return remaining  # chunking off: the first request may exceed the budget, alone
        return remaining if remaining <= self.rem_tokens else 0  # whole or not at all

    def _fits(self, remaining: int) -> int:
        """``_slice``, or 0 where only a whole prompt may join and this one would be cut."""
        n = self._slice(remaining)
        return 0 if self.whole_only and n < remaining else n

    def _take(self, remaining: int, n: int, continuing: bool = False) -> int:
        self.num_reqs += 1
        self.batch_tokens += n
        self.rem_tokens -= n
        if n < remaining and continuing:
            self.whole_only = True
        elif n < remaining:
            self.closed = True
        if self.rem_tokens <= 0:
            self.closed = True
        return n

    def add_chunked(self, remaining: int) -> int:
        """The chunked request continues; it already holds its pages, so it always goes first
        and always gets a slice (``>= 1`` token) — it must progress to ever free them."""
        if self.num_reqs:
            raise ValueError("the chunked request must be added first")
        if remaining < 1:
            raise ValueError(f"chunked request with {remaining} tokens left")
        return self._take(remaining, self._slice(remaining), continuing=True)

    def waits_for_chunk(self, prompt_len: int, cached_len: int) -> bool:
        """Whether this request would be cut while another one is the chunked request: it cannot
        start this step, and the requests behind it may still join whole (module docstring)."""
        if self.closed or not self.whole_only or not 0 <= cached_len < prompt_len:
            return False
        remaining = prompt_len - cached_len
        return self._slice(remaining) < remaining

    def can_add(self, prompt_len: int, cached_len: int) -> bool:
        """Whether ``add_new`` could accept this request; read-only. A necessary condition only
        (locking the prefix may still take pages), so a caller can skip matching and locking
        the cached prefix of a request that cannot run now."""
        if self.closed or not 0 <= cached_len < prompt_len:
            return not self.closed
        need = pages_for(prompt_len, self.page_size) - cached_len // self.page_size
        return self._fits(prompt_len - cached_len) > 0 and need <= self.rem_pages

    def add_new(self, prompt_len: int, cached_len: int, lock_pages: int = 0) -> int | None:
        """Tokens to compute for a new request this step, or None when it does not fit.

        ``cached_len``: prompt tokens its cached prefix provides (page-aligned, < prompt_len).
        ``lock_pages``: pages that locking that prefix removed from ``available_pages``.
        On None nothing changed and the caller should stop adding (FCFS: no overtaking).
        """
        if self.closed:
            return None
        if not 0 <= cached_len < prompt_len or cached_len % self.page_size:
            raise ValueError(f"bad cached prefix {cached_len} for a {prompt_len}-token prompt (page {self.page_size})")
        remaining = prompt_len - cached_len
        n = self._fits(remaining)
        if n <= 0:
            return None
        need = pages_for(prompt_len, self.page_size) - cached_len // self.page_size + lock_pages
        if need > self.rem_pages:
            return None
        self.rem_pages -= need
        return self._take(remaining, n)


def order_waiting(reqs: Sequence[T], policy: Policy, prefix_len: Callable[[T], int]) -> list[T]:
    """The order in which waiting requests are offered to the adder.

    fcfs: arrival order. lpm (longest prefix match): most cached prompt tokens first, ties in
    arrival order, so requests sharing a hot prefix run while it is still cached. ``prefix_len``
    is called once per request, and only for lpm with 2 to ``LPM_MAX_QUEUE`` requests; it must
    not change the cache (``RadixCache.peek_prefix_len``): most of them are not admitted.
    """
    if policy not in ("fcfs", "lpm"):
        raise ValueError(f"unknown schedule policy {policy!r}")
    if policy == "fcfs" or len(reqs) < 2 or len(reqs) > LPM_MAX_QUEUE:
        return list(reqs)
    keyed = [(-prefix_len(r), i, r) for i, r in enumerate(reqs)]
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [r for _, _, r in keyed]
