"""Run the engine as a tensor-parallel group of N processes (gloo over loopback) for tests.

    run_tp(model_dir, tp_size, prompts, kv_prompt) -> [RankResult per rank]

Each rank is a spawned process that joins the group, builds its ModelRunner (its shard of the
weights, a KV pool of its own KV heads), then

1. prefills ``kv_prompt`` alone and reports every attention layer's K/V at its slots, and
2. generates ``prompts`` (greedy, or with the given sampling params) through ``LocalEngine`` (paged KV, chunked prefill, prefix cache,
   batched decode), reporting the output ids.

Bounded: the group's collectives time out, the parent waits at most ``timeout_s`` and kills any
rank still alive by PID.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from common.ports import free_port
MAX_NEW = 12


@dataclass
class RankResult:
    rank: int
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    kv_pool_heads: int  # heads of the rank's KV pool buffers
    # Per attention layer: [len(kv_prompt), kv_heads, head_dim]. numpy on the way (a tensor would
    # travel as shared memory owned by the rank process, gone once it exits), tensors after.
    k: list[Any]
    v: list[Any]
    outputs: list[list[int]]


def run_ranks(target: Any, size: int = 2, timeout_s: float = 120.0) -> tuple[list[Any], list[int | None]]:
    """Spawn ``size`` processes ``target(rank, port, queue)`` that join one group on a free port;
    return what each put on the queue, sorted (fewer when a rank did not report in time), and
    their exit codes. Every rank still alive afterwards is killed by PID."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        for _ in procs:
            got.append(out.get(timeout=timeout_s))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                os.kill(p.pid, 9)  # type: ignore[arg-type]
                p.join(timeout=10)
    return sorted(got), [p.exitcode for p in procs]


def prefill_kv(runner: Any, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill ``prompt`` alone in ``runner``; every attention layer's K/V at its slots, copied."""
    from common.engine.model_runner import ExtendChunk

    kv = runner.memory.admit(prompt)
    assert kv is not None and runner.memory.reserve(kv, len(prompt))
    runner.extend([ExtendChunk(kv.row, prompt, 0)])
    slots = runner.req_to_token.table[kv.row, : len(prompt)].long()  # [T]
    pool = runner.kv_pool
    k = [b[slots].clone() for b in pool.k_buffers]
    v = [b[slots].clone() for b in pool.v_buffers]
    runner.memory.release(kv, None)
    return k, v


def build(model_dir: str, tp: Any = None) -> tuple[Any, Any]:
    """(LocalEngine, ModelRunner) over ``model_dir`` on CPU, float32, as the engine tests build it."""
    from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve
    from common.engine.driver import EngineDriver
    from common.engine.model_runner import ModelRunner
    from common.engine.sampler import Sampler
    from common.parallel import SINGLE_RANK
    from common.sched.stop import StopChecker
    from tests.local_engine import LocalEngine

    cfg = resolve(NodeConfig(
        role="prefill",
        model=ModelConfig(model_path=model_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(page_size=16, max_total_tokens=8192, max_running_requests=32),
        attention=AttentionConfig(backend="torch"),
    ))
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention, tp or SINGLE_RANK)
    engine = LocalEngine(EngineDriver(runner, Sampler()), runner.memory, StopChecker(runner.arch.eos_token_ids),
                         chunk_size=48, max_prefill_tokens=48 * 4)
    return engine, runner


def _rank_main(rank: int, size: int, port: int, model_dir: str, prompts: list[list[int]], kv_prompt: list[int],
               params: list[Any] | None, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        from common.parallel import init_tp_group
        from common.request import SamplingParams

        tp = init_tp_group(rank, size, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=120)
        try:
            engine, runner = build(model_dir, tp)
            k, v = prefill_kv(runner, kv_prompt)
            greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            results = engine.generate(prompts, params or [greedy] * len(prompts))
            runner.memory.check_integrity()
            shard = runner.model.layers[0].self_attn.shard
            out.put(RankResult(rank, shard.q_head_start, shard.num_heads, shard.kv_head_start, shard.num_kv_heads,
                               runner.kv_pool.layout.num_kv_heads, [t.numpy() for t in k], [t.numpy() for t in v],
                               [r.output_ids for r in results]))
        finally:
            tp.close()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def run_tp(model_dir: str, tp_size: int, prompts: list[list[int]], kv_prompt: list[int],
           params: list[Any] | None = None, timeout_s: float = 240.0) -> list[RankResult]:
    """``params``: SamplingParams per prompt (default: greedy, ignore_eos, MAX_NEW tokens). Each
    rank's sampler is unseeded (its own OS-seeded generator), as in a node."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, port, model_dir, prompts, kv_prompt, params, out), daemon=True)
             for r in range(tp_size)]
    for p in procs:
        p.start()
    results: dict[int, RankResult] = {}
    errors: list[str] = []
    try:
        for _ in range(tp_size):
            item = out.get(timeout=timeout_s)
            if isinstance(item, RankResult):
                item.k = [torch.from_numpy(a) for a in item.k]
                item.v = [torch.from_numpy(a) for a in item.v]
                results[item.rank] = item
            else:
                errors.append(f"rank {item[0]} failed:\n{item[1]}")
                break  # its peers now wait on a collective it will never join
        for p in procs:
            p.join(timeout=30)
    except queue.Empty:
        errors.append(f"no result from some rank within {timeout_s:.0f}s (got ranks {sorted(results)})")
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)  # type: ignore[arg-type]
                p.join(timeout=10)
        out.close()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(tp_size)]
