"""What the KV integrity digests cost, next to the forward that wrote the KV:
``python -m common.tools.bench_kv_digest --model-path DIR [--tokens 512] [--cpu-threads 1]``.

One prompt of ``--tokens`` tokens is prefilled (the engine alone, no server), then its KV pages are
digested as the prefill node does after a forward (``common/kvcache/page_digest.py``); the best of
``--repeat`` runs of each is printed, with the ratio. The decode's check on arrival digests the
same bytes once more, so each role pays about this ratio of a prefill forward.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from common import host_malloc
from common.config import AttentionConfig, CacheConfig, ConfigError, ModelConfig, NodeConfig, resolve
from common.engine.model_runner import ExtendChunk, ModelRunner, page_digests
from common.models import ModelLoadError

PAGE_SIZE = 16


def measure(runner: ModelRunner, tokens: int, repeat: int) -> tuple[float, float, int]:
    """(best forward seconds, best digest seconds, KV bytes digested)."""
    digests = page_digests(runner, "bench-kv-digest-secret")
    vocab = runner.arch.vocab_size
    ids = [(7 * i + 3) % (vocab - 5) + 5 for i in range(tokens)]  # any ids inside the vocabulary
    best_f = best_d = float("inf")
    for _ in range(repeat):
        kv = runner.memory.admit(ids, use_cache=False)
        assert kv is not None and runner.memory.reserve(kv, tokens)
        t0 = time.perf_counter()
        runner.extend([ExtendChunk(kv.row, ids, 0)])
        best_f = min(best_f, time.perf_counter() - t0)
        pages = kv.pages[: -(-tokens // PAGE_SIZE)]
        t0 = time.perf_counter()
        digests.record(pages[:-1])
        digests.record(pages[-1:], valid_last=tokens - (len(pages) - 1) * PAGE_SIZE)
        best_d = min(best_d, time.perf_counter() - t0)
        kv.kv_len = tokens
        runner.memory.release(kv, None)
    layout = runner.kv_pool.layout
    return best_f, best_d, tokens * layout.bytes_per_token_per_layer * 2 * layout.num_layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.bench_kv_digest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.tokens < 1 or a.repeat < 1 or a.cpu_threads < 1:
        print("bench_kv_digest: --tokens, --repeat and --cpu-threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(a.cpu_threads)
    host_malloc.tune()  # as a node's scheduler process does
    try:
        cfg = resolve(NodeConfig(role="prefill", model=ModelConfig(model_path=a.model_path, device="cpu"),
                                 cache=CacheConfig(page_size=PAGE_SIZE, max_total_tokens=2 * a.tokens + 4 * PAGE_SIZE,
                                                   max_running_requests=2, enable_prefix_cache=False),
                                 attention=AttentionConfig(backend="torch")))
        runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    except (ConfigError, ModelLoadError) as exc:
        print(f"bench_kv_digest: {exc}", file=sys.stderr)
        return 2
    fwd, dig, nbytes = measure(runner, a.tokens, a.repeat)
    print(f"model {a.model_path}, {a.tokens} tokens, {a.cpu_threads} thread(s): prefill forward {fwd * 1e3:.1f} ms, "
          f"digest of its {nbytes / 2**20:.1f} MiB of KV {dig * 1e3:.2f} ms ({nbytes / dig / 1e9:.2f} GB/s) = "
          f"{100 * dig / fwd:.2f} % of the forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
