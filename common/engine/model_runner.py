"""Model + KV memory + attention backend on one device; one forward per call.

The runner owns the tensors (weights, K/V pool, req->token table). Bookkeeping of who holds
which page lives in ``KVMemory`` (built here, used by the schedulers); the runner never decides
what runs, it only turns a list of extend chunks or decode items into logits.

On a GPU whose attention backend supports it, decode steps of up to ``--cuda-graph-max-bs``
requests replay captured CUDA graphs (``cuda_graph.py``); everything else runs eagerly.

Under tensor parallelism every rank has its own runner over its shard of the weights and a KV
pool of its own KV heads; the page count is agreed (the minimum over the ranks) so that page ids,
which every rank's identical scheduler hands out, mean the same slots on every rank.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common import kernels
from common.attention.base import AttentionBackend
from common.config import AttentionConfig, CacheConfig, ConfigError, ModelConfig
from common.engine.cuda_graph import CudaGraphCapture, DecodeGraphs, GraphCapture, capture_sizes
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.kvcache.allocator import PageAllocator
from common.kvcache.page_digest import PageDigests, digest_key
from common.kvcache.pool import RESERVED_PAGES, KVPool
from common.kvcache.radix_cache import RadixCache
from common.kvcache.req_kv import KVMemory
from common.kvcache.req_to_token import ReqToTokenPool
from common.kvcache.state_pool import StatePool
from common.models.linear import AUTO_MIN_ELEMENTS, pack_linears, pack_lm_head, resolve_mode, splits_well
from common.models.native_decode import NativeDecode
from common.models.llama import Attention
from common.parallel import SINGLE_RANK, TPGroup, rank_device

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 65536  # no "free memory" to size from on a CPU; tiny models need little


@dataclass(frozen=True)
class ExtendChunk:
    """Append ``input_ids`` after ``prefix_len`` tokens already in the pool (slots pre-reserved)."""

    row: int
    input_ids: Sequence[int]
    prefix_len: int


@dataclass(frozen=True)
class DecodeItem:
    """Append one token at position ``prefix_len`` (its K/V is written this step)."""

    row: int
    input_id: int
    prefix_len: int


def create_attention_backend(cfg: AttentionConfig, device: str) -> AttentionBackend:
    name = cfg.backend
    if name == "torch":
        from common.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(decode_mirror_bytes=cfg.torch_decode_mirror_mib << 20,
                                     cpu=not device.startswith("cuda"))
    if name == "flashinfer":
        if not device.startswith("cuda"):
            raise ConfigError("--attention-backend flashinfer needs a CUDA device")
        from common.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device)
    raise ConfigError(f"unknown attention backend {name!r}")


def page_digests(runner: ModelRunner, secret: str | None) -> PageDigests:
    """Digests over the runner's KV pool, keyed for its cluster (common/kvcache/page_digest.py)."""
    pool = runner.kv_pool
    return PageDigests(pool.buffers(), pool.page_size, pool.num_pages, digest_key(secret))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig, attention_cfg: AttentionConfig,
                 tp: TPGroup = SINGLE_RANK) -> None:
        """``model_cfg`` and ``attention_cfg`` must be resolved (no "auto" left; see config.resolve).
        ``tp``: the node's TP group; this runner is rank ``tp.rank``'s, on GPU ``cuda:<rank>`` when
        the device is plain ``cuda`` (an explicit ``cuda:N`` is taken as it is)."""
        from common.models import load_model

        self.tp = tp
        device = rank_device(model_cfg.device, tp.rank, tp.size)
        self.device = torch.device(device)
        self.dtype = getattr(torch, model_cfg.dtype)
        self.attn_backend = create_attention_backend(attention_cfg, device)
        self.model = load_model(model_cfg.model_path, self.dtype, self.device, self.attn_backend, tp)
        # Packed after loading: the loader and the TP shards fill plain parameters.
        try:
            self.cpu_linear = resolve_mode(model_cfg.cpu_linear, self.device, self.dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        native = kernels.linear() if self.cpu_linear in ("auto", "native") else None  # None: oneDNN packs
        # auto: every projection for our kernel where it builds (a tiny model's too: its decode step
        # is then one call of the whole-step kernel, below), else only large ones for oneDNN.
        small_too = self.cpu_linear != "auto" or native is not None
        self.packed_linears = 0 if self.cpu_linear == "plain" else pack_linears(
            self.model, min_elements=0 if small_too else AUTO_MIN_ELEMENTS,
            dtype=torch.bfloat16 if self.cpu_linear == "bf16" else None, native=native)
        # The LM head too, for our kernel only (an embedding tied to it is looked up from its layout).
        head = native is not None and pack_lm_head(self.model, native)
        self.splits_well = self.packed_linears > 0 and splits_well(self.model)
        if self.packed_linears:
            log.info("packed %d projections%s for %s (--cpu-linear %s)", self.packed_linears,
                     " and the LM head" if head else "", "oneDNN" if native is None else "our kernel", self.cpu_linear)
        self.arch = self.model.arch
        page_size = cache_cfg.page_size
        ctx = model_cfg.context_length or self.arch.max_position_embeddings
        self.context_length = ctx
        self.model.rotary.reserve(ctx)  # the fused RoPE kernel's table (a no-op on CPU)
        # Rows are whole pages long so a request's last page never spills past its row.
        row_len = -(-ctx // page_size) * page_size
        layout = self.arch.kv_layout(page_size, model_cfg.dtype, tp.size, tp.rank)  # this rank's KV heads
        num_pages = self._agreed(self._num_pages(cache_cfg, layout.bytes_per_page_per_layer * 2 * layout.num_layers))
        self.kv_pool = KVPool(layout, num_pages, self.device)
        self.req_to_token = ReqToTokenPool(cache_cfg.max_running_requests, row_len, self.device)
        allocator = PageAllocator(num_pages)
        state_layout = self.arch.state_layout(model_cfg.dtype)
        # One state slot per request row: a request never waits for a slot once it has a row.
        self.state_pool = None if state_layout is None else StatePool(state_layout, cache_cfg.max_running_requests, self.device)
        prefix_cache = cache_cfg.enable_prefix_cache and self.state_pool is None
        if cache_cfg.enable_prefix_cache and not prefix_cache:
            # A cached prefix has KV pages but not the recurrent state after its last token.
            log.info("prefix cache off: %s keeps recurrent state, which the cache does not hold", self.arch.architecture)
        cache = RadixCache(allocator, page_size, enabled=prefix_cache)
        self.memory = KVMemory(allocator, self.req_to_token, cache, page_size, self.state_pool)
        # A whole decode step in one native call where the model, weights and backend allow (CPU).
        self.native_decode = NativeDecode.build(self.model, self.attn_backend, self.kv_pool, tp)
        # Decode steps that ran as that one call (the decode's /metrics, beside its decode steps: a
        # node whose mirror outgrew its budget, say, shows steps falling back to the layers).
        self.native_decode_steps = 0
        log.info("KV pool: %d pages x %d tokens (%.1f MiB), %d request rows of %d%s", num_pages, page_size,
                 self.kv_pool.nbytes() / 2**20, cache_cfg.max_running_requests, row_len,
                 "" if self.state_pool is None else f", state {self.state_pool.nbytes() / 2**20:.1f} MiB")
        self.graphs = self.capture_decode_graphs(attention_cfg, cache_cfg.max_running_requests)

    def capture_decode_graphs(self, cfg: AttentionConfig, max_running: int,
                       capture: GraphCapture | None = None) -> DecodeGraphs | None:
        """Capture the decode forward where it can run as CUDA graphs (``capture`` overrides the
        CUDA capture: tests pass ``EagerCapture`` to run the same path on CPU)."""
        if capture is None:
            if cfg.disable_cuda_graph or self.device.type != "cuda":
                return None
            if not self.attn_backend.supports_cuda_graph:
                log.info("CUDA graphs off: the %s attention backend cannot be captured", cfg.backend)
                return None
            if self.tp.size > 1:
                # NCCL collectives can be captured, but that path has not run on a multi-GPU box here.
                log.info("CUDA graphs off under tensor parallelism (tp %d): decode runs eagerly", self.tp.size)
                return None
            capture = CudaGraphCapture(self.device)
        layer = next(m.spec for m in self.model.modules() if isinstance(m, Attention))
        return DecodeGraphs(self.model, self.attn_backend, layer, self.kv_pool, self.req_to_token,
                            self.memory.row_state, self.state_pool, capture_sizes(min(cfg.cuda_graph_max_bs, max_running)),
                            self.dtype, capture)

    def _agreed(self, num_pages: int) -> int:
        """The smallest page count over the TP ranks (free GPU memory differs between devices)."""
        if self.tp.size == 1:
            return num_pages
        return int(self.tp.all_reduce(torch.tensor([num_pages], dtype=torch.int64, device=self.device), op="min").item())

    def _num_pages(self, cfg: CacheConfig, bytes_per_page: int) -> int:
        if cfg.max_total_tokens is not None:
            return cfg.max_total_tokens // cfg.page_size + RESERVED_PAGES
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.mem_fraction_static)
            pages = budget // bytes_per_page
            if pages <= RESERVED_PAGES + 1:
                raise ConfigError(f"--mem-fraction-static {cfg.mem_fraction_static} leaves no room for the KV cache")
            return pages
        return CPU_DEFAULT_KV_TOKENS // cfg.page_size + RESERVED_PAGES

    # -- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, chunks: Sequence[ExtendChunk]) -> torch.Tensor:
        """Run prompt chunks; returns logits of each chunk's last token. [B, vocab] float32."""
        ids: list[int] = []
        pos: list[int] = []
        prefix = [c.prefix_len for c in chunks]
        lens = [len(c.input_ids) for c in chunks]
        for c in chunks:
            if not c.input_ids:
                raise ValueError(f"empty extend chunk for row {c.row}")
            ids.extend(c.input_ids)
            pos.extend(range(c.prefix_len, c.prefix_len + len(c.input_ids)))
        batch = self._batch(ForwardMode.EXTEND, ids, pos, [c.row for c in chunks], prefix, lens)
        return self._run(batch)

    @torch.inference_mode()
    def decode(self, items: Sequence[DecodeItem]) -> torch.Tensor:
        """One token per request; returns next-token logits. [B, vocab] float32."""
        prefix = [d.prefix_len for d in items]
        if self.graphs is not None and self.graphs.fits(len(items)):
            return self.graphs.run([d.input_id for d in items], prefix, [d.row for d in items])
        batch = self._batch(ForwardMode.DECODE, [d.input_id for d in items], prefix, [d.row for d in items], prefix, [1] * len(items))
        return self._run(batch)

    def _batch(self, mode: ForwardMode, ids: list[int], pos: list[int], rows: list[int], prefix: list[int], lens: list[int]) -> ForwardBatch:
        dev = self.device
        table = self.req_to_token.table
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)  # [B]
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)  # [T]
        # Each new token's slot is already in the request's row (reserved by the scheduler).
        # Decode has one token per row: no repeat_interleave (tens of microseconds a step on CPU).
        tok_rows = rows_t if mode is ForwardMode.DECODE else torch.repeat_interleave(rows_t, torch.tensor(lens, device=dev))  # [T]
        out_loc = table[tok_rows, pos_t].long()  # [T]
        seq = [p + n for p, n in zip(prefix, lens)]
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=pos_t,
            out_cache_loc=out_loc,
            req_pool_indices=rows_t,
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev),
            prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=dev),
            extend_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
            req_to_token=table,
            kv_pool=self.kv_pool,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=lens,
            rows_cpu=rows,
            row_epochs=[self.req_to_token.epoch[r] for r in rows],
            state_pool=self.state_pool,
            state_slots=None if self.state_pool is None else self.memory.row_state[rows_t],
        )

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(batch)
        try:
            if self.native_decode is not None and self.native_decode.takes(batch):
                logits = self.native_decode.logits(batch)  # the whole step in one call (CPU)
                self.native_decode_steps += 1
                return logits
            hidden = self.model.forward(batch)  # [B, hidden]
        except BaseException:
            self.attn_backend.reset()  # state it planned for this step was only partly written
            raise
        return self.model.compute_logits(hidden)  # [B, vocab] float32
