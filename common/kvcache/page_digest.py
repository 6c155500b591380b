"""Keyed digests of KV pages: notice K/V bytes that our own forward did not write.

The data plane cannot authenticate writers: anyone who reaches a node's Mooncake port and knows
a registered buffer's address can write into its KV pool. So the nodes check what they are
about to trust instead of who wrote it::

    prefill, after each forward    digest every page the chunk completed (and the prompt's
                                   partial last page): ``record``
    prefill, prefix-cache hit      the matched pages must still have their digests
                                   (``first_mismatch``); from the first that does not, the cached
                                   branch is dropped and the prompt is recomputed from there
    prefill, last chunk            the room's digest, over the recorded page digests in order
                                   (``room_digest``), travels in the aux row
    decode, transfer Success       digest what arrived and compare (``arrived_intact``); a
                                   mismatch fails the request (the router retries it elsewhere)

A write landing between our forward and the transfer's read is caught at the decode (what
arrived is not what we computed), as is one into the decode's pages while they are written.

Digest: HMAC-SHA256 truncated to 128 bits. Keyed, because CRC-like sums can be forged by whoever
reads the page and writes it back with a fix-up; a keyed MAC cannot without the key, which never
leaves the process memory (it is not in any registered buffer). SHA-256 rather than BLAKE2b:
OpenSSL runs it on the CPU's SHA extensions, 2.3x BLAKE2b's speed on this project's machines. The
key is derived from the cluster secret, which prefill and decode share; without a secret it is a
public constant, and the check still catches stray and garbage writes but not a forger who knows
this code. Cost: one pass over every KV byte per role (docs/BENCHMARKS.md).
On CUDA the pages are gathered on the device into [page, buffer, slot] blocks, a batch at a time,
copied to a pinned host buffer in one transfer, and hashed by a few threads (hashlib releases the
GIL): the same bytes in the same order as the host path, so a CPU node and a GPU node of one
cluster agree. Copying each page of each layer on its own (one transfer and one sync each) made
the prefill of a Qwen3-0.6B-shaped model on an H200 spend ~20 s of its scheduler loop per 85 k
prompt tokens on digests alone (docs/BENCHMARKS.md, "GPU").
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

DIGEST_BYTES = 16
_KEY_CONTEXT = b"pdcluster/kv-digest/v1"
_OPEN_KEY = b"pdcluster/kv-digest/open-v1"
STAGING_BYTES = 64 << 20  # device path: pages gathered and copied to the host per batch


def digest_key(secret: str | None) -> bytes:
    """The key both roles of one cluster use (their shared secret's, else a public constant)."""
    return hmac.new(secret.encode(), _KEY_CONTEXT, hashlib.sha256).digest() if secret else _OPEN_KEY


def _same(value: int) -> int:
    return value


class PageDigests:
    """Digests of the pages of one KV pool (``buffers``: every layer's K and V tensor, each
    ``[num_pages * page_size, ...]``), one slot per page id."""

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int, num_pages: int, key: bytes,
                 batched: bool | None = None, threads: int | None = None) -> None:
        """``batched``: gather and copy pages in batches (default: when the buffers are on a GPU;
        tests force it on CPU to check it gives the host path's digests). ``threads``: hashing
        threads of the batched path (default: up to 4 of the cores this process may use)."""
        self.page_size = page_size
        self._key = key
        self._buffers = list(buffers)
        self._host = all(b.device.type == "cpu" for b in self._buffers)
        self._batched = not self._host if batched is None else batched
        self._page_bytes = sum(b[:page_size].numel() * b.element_size() for b in self._buffers)
        self._per_batch = max(1, STAGING_BYTES // self._page_bytes)
        self._staging: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(threads or min(4, len(os.sched_getaffinity(0))), thread_name_prefix="kv-digest") \
            if self._batched else None
        # Host buffers as [slots, bytes per slot] uint8 views sharing memory: hashed without a copy.
        self._views = [b.view(torch.uint8).reshape(b.shape[0], -1).numpy() for b in self._buffers] if self._host else []
        self._table = np.zeros((num_pages, DIGEST_BYTES), dtype=np.uint8)
        self._known = np.zeros(num_pages, dtype=bool)
        self.failures = 0  # mismatches found, for /metrics
        # TP nodes: the MIN over the ranks (each digests its own heads), so every rank drops the
        # same cached branch; one rank alone keeps its own answer.
        self.agree_min: Callable[[int], int] = _same

    def compute(self, page: int, valid: int | None = None) -> bytes:
        """The digest of the first ``valid`` (default: all) token slots of ``page`` as they are now."""
        start = page * self.page_size
        end = start + (self.page_size if valid is None else valid)
        h = hmac.new(self._key, np.int64(valid if valid is not None else self.page_size).tobytes(), hashlib.sha256)
        if self._host:
            for view in self._views:
                h.update(view[start:end])
        else:
            for buf in self._buffers:
                h.update(buf[start:end].view(torch.uint8).cpu().numpy())
        return h.digest()[:DIGEST_BYTES]

    def compute_many(self, pages: Sequence[int], valid_last: int | None = None) -> list[bytes]:
        """``compute`` of each page (``valid_last``: the last one's valid slots), batched on a GPU."""
        if not pages:
            return []
        if not self._batched:
            return [self.compute(p, valid_last if i == len(pages) - 1 else None) for i, p in enumerate(pages)]
        partial = valid_last is not None and valid_last != self.page_size
        full = list(pages[:-1] if partial else pages)
        out: list[bytes] = []
        for start in range(0, len(full), self._per_batch):
            out += self._digest_full_pages(full[start : start + self._per_batch])
        if partial:
            out.append(self.compute(pages[-1], valid_last))
        return out

    def _digest_full_pages(self, pages: list[int]) -> list[bytes]:
        """One gather per buffer into [page, buffer, slot bytes] blocks, one copy to the host, the
        pages hashed in the thread pool. Each block holds what ``compute`` feeds its MAC in order."""
        ps, n = self.page_size, len(pages)
        idx = torch.tensor(pages, dtype=torch.int64, device=self._buffers[0].device)
        blocks = torch.stack([b.view(torch.uint8).view(b.shape[0] // ps, -1).index_select(0, idx)
                              for b in self._buffers], dim=1)  # [n, buffers, page bytes per buffer]
        flat = blocks.view(n, -1)
        if self._host:
            host = flat.numpy()
        else:
            if self._staging is None:
                self._staging = torch.empty(self._per_batch * self._page_bytes, dtype=torch.uint8, pin_memory=True)
            staged = self._staging[: flat.numel()].view(n, -1)
            staged.copy_(flat)  # pinned: one DMA; waits for the gather
            host = staged.numpy()
        prefix = np.int64(ps).tobytes()
        assert self._pool is not None
        return list(self._pool.map(lambda row: self._mac(prefix, row), host))

    def _mac(self, prefix: bytes, row: np.ndarray) -> bytes:
        h = hmac.new(self._key, prefix, hashlib.sha256)
        h.update(row)
        return h.digest()[:DIGEST_BYTES]

    def record(self, pages: Sequence[int], valid_last: int | None = None) -> None:
        """Digest ``pages`` as our forward just wrote them (``valid_last``: tokens in the last one
        when it is partly filled)."""
        for page, d in zip(pages, self.compute_many(pages, valid_last)):
            self._table[page] = np.frombuffer(d, dtype=np.uint8)
            self._known[page] = True

    def first_mismatch(self, pages: Sequence[int]) -> int | None:
        """Index in ``pages`` of the first full page whose bytes are not what was recorded (or that
        has no record) on any TP rank, None when all match."""
        known = len(pages)
        for i, page in enumerate(pages):
            if not self._known[page]:
                known = i
                break
        first = known
        for i, d in enumerate(self.compute_many(pages[:known])):
            if d != self._table[pages[i]].tobytes():
                first = i
                break
        first = self.agree_min(first)
        return None if first == len(pages) else first

    def room_digest(self, pages: Sequence[int], num_tokens: int) -> bytes:
        """The digest of a prompt's KV (``num_tokens`` tokens on ``pages``, in order) from the
        recorded page digests: no page is read again."""
        h = hmac.new(self._key, np.int64(num_tokens).tobytes(), hashlib.sha256)
        for page in pages[: -(-num_tokens // self.page_size)]:
            if not self._known[page]:
                raise ValueError(f"page {page} has no recorded digest")
            h.update(self._table[page].tobytes())
        return h.digest()[:DIGEST_BYTES]

    def arrived_intact(self, pages: Sequence[int], num_tokens: int, expected: bytes, record: bool = False) -> bool:
        """Whether ``num_tokens`` tokens of KV on ``pages`` are what the sender digested. With
        ``record``, an intact arrival's full pages keep the digests just computed (no second pass),
        for a later ``first_mismatch`` (the decode's prefix cache)."""
        n = -(-num_tokens // self.page_size)
        h = hmac.new(self._key, np.int64(num_tokens).tobytes(), hashlib.sha256)
        full: list[tuple[int, bytes]] = []
        last_valid = num_tokens - (n - 1) * self.page_size
        last_valid_or_none = None if last_valid == self.page_size else last_valid
        for i, (page, d) in enumerate(zip(pages[:n], self.compute_many(pages[:n], last_valid_or_none))):
            h.update(d)
            if i < n - 1 or last_valid_or_none is None:
                full.append((page, d))
        ok = hmac.compare_digest(h.digest()[:DIGEST_BYTES], expected)
        if not ok:
            self.failures += 1
        elif record:
            for page, d in full:
                self._table[page] = np.frombuffer(d, dtype=np.uint8)
                self._known[page] = True
        return ok
