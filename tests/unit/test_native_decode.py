"""The whole-step decode kernel (common/models/native_decode.py, common/kernels/decode_step.cpp)
against the layer-by-layer path with the same kernels inside: two runners on one checkpoint take
the same requests through the same steps (requests join, leave, reorder, skip a step, reuse a
row, outgrow the mirror's lanes and key capacity), and every step's logits, every new K/V in the
pool, and what later steps read back must agree to float32 rounding. Both archs, Qwen2's q/k/v
bias, Llama with every bias, Qwen3's per-head norms, one and two threads. Greedy agreement with
HF on this path is test_engine_vs_hf.py's "native" case."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from common import kernels
from common.config import AttentionConfig, CacheConfig, ModelConfig, NodeConfig, resolve
from common.engine.model_runner import DecodeItem, ExtendChunk, ModelRunner
from common.kvcache.req_kv import ReqKV

pytestmark = pytest.mark.skipif(kernels.decode_step() is None, reason="no C++ compiler: the whole-step kernel cannot build")

PAGE = 4
ATOL = RTOL = 1e-4


def make_runner(model_dir: str, native_step: bool, cpu_linear: str = "native", mirror_mib: int = 64) -> ModelRunner:
    cfg = resolve(NodeConfig(
        role="decode",
        model=ModelConfig(model_path=model_dir, device="cpu", dtype="float32", cpu_linear=cpu_linear),
        cache=CacheConfig(page_size=PAGE, max_total_tokens=4096, max_running_requests=16, enable_prefix_cache=False),
        attention=AttentionConfig(backend="torch", torch_decode_mirror_mib=mirror_mib),
    ))
    runner = ModelRunner(cfg.model, cfg.cache, cfg.attention)
    if not native_step:
        runner.native_decode = None
    return runner


class Pair:
    """The same requests on a whole-step runner and a layer-by-layer one."""

    def __init__(self, model_dir: str) -> None:
        self.native, self.layered = make_runner(model_dir, True), make_runner(model_dir, False)
        assert self.native.native_decode is not None
        self.steps = 0
        forward = self.native.native_decode.logits

        def counted(batch):  # type: ignore[no-untyped-def]
            self.steps += 1
            return forward(batch)

        self.native.native_decode.logits = counted  # type: ignore[method-assign]
        self.kv: dict[int, tuple[ReqKV, ReqKV]] = {}  # request id -> its KV on each runner
        self.last: dict[int, int] = {}  # request id -> the token it feeds next
        self.vocab = self.native.arch.vocab_size

    def admit(self, rid: int, prompt: list[int], budget: int) -> None:
        kvs = []
        for runner in (self.native, self.layered):
            kv = runner.memory.admit(prompt)
            assert kv is not None and runner.memory.reserve(kv, len(prompt) + budget)
            kvs.append(kv)
        a, b = kvs
        assert a.row == b.row  # the same operations on the same pools: the same rows and slots
        logits = [r.extend([ExtendChunk(kv.row, prompt, 0)]) for r, kv in ((self.native, a), (self.layered, b))]
        torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=RTOL)  # extend runs the layers on both
        a.kv_len = b.kv_len = len(prompt)
        self.kv[rid] = (a, b)
        self.last[rid] = int(logits[0][0].argmax())

    def step(self, rids: list[int]) -> None:
        outs = []
        for side, runner in enumerate((self.native, self.layered)):
            items = [DecodeItem(self.kv[r][side].row, self.last[r], self.kv[r][side].kv_len) for r in rids]
            outs.append(runner.decode(items))
        torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL)
        for r, row in zip(rids, outs[0]):
            for kv in self.kv[r]:
                kv.kv_len += 1
            self.last[r] = int(row.argmax())

    def finish(self, rid: int) -> None:
        for runner, kv in zip((self.native, self.layered), self.kv.pop(rid)):
            runner.memory.release(kv, None)

    def check_pools(self) -> None:
        """Every K/V either side wrote (prompts by extend, new tokens by each decode path)."""
        for mine, theirs in zip(self.native.kv_pool.buffers(), self.layered.kv_pool.buffers()):
            torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=RTOL)


def run_schedule(pair: Pair, seed: int) -> None:
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(3, pair.vocab) for _ in range(n)]  # noqa: E731
    for rid, n in enumerate((5, 17, 60, 1, 33)):  # 60: its lane outgrows the first key capacity (64)
        pair.admit(rid, prompt(n), budget=40)
    live = list(range(5))
    for step in range(24):
        if step == 4:
            live.remove(1)  # skips steps 4-5, then returns with a stale lane: refilled
        if step == 6:
            live.append(1)
        if step == 8:
            pair.finish(3)  # leaves: the last lane moves into its hole
            live.remove(3)
            pair.admit(3, prompt(9), budget=40)  # a new request, likely on the freed row (new epoch)
            live.append(3)
        if step == 10:
            for rid in range(5, 12):  # past 8 lanes: the lanes' capacity grows
                pair.admit(rid, prompt(3 + rid), budget=40)
            live.extend(range(5, 12))
        if step == 16:
            for rid in (0, 6, 9):
                pair.finish(rid)
                live.remove(rid)
        rng.shuffle(live)  # batch order differs from lane order
        pair.step(list(live))
    pair.check_pools()
    for rid in list(pair.kv):
        pair.finish(rid)
    for runner in (pair.native, pair.layered):
        runner.memory.check_integrity()
        stats = runner.memory.stats()
        assert stats["used_pages"] == 0 and stats["free_req_slots"] == stats["total_req_slots"], stats


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}),  # per-head q/k norms, tied embeddings
    ("llama", {}),  # llama3 RoPE scaling
    ("qwen2", {}),  # q/k/v bias
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # every projection's bias
], ids=["qwen3", "llama", "qwen2", "llama-bias"])
def test_whole_step_matches_layer_path(tiny_model_factory: Callable[..., str], arch: str,
                                       overrides: dict[str, bool]) -> None:
    pair = Pair(tiny_model_factory(arch, **overrides))
    run_schedule(pair, seed=len(arch))
    assert pair.steps == 24  # every decode step ran the whole-step kernel


def test_whole_step_on_two_threads(tiny_qwen3: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pair = Pair(tiny_qwen3)
        run_schedule(pair, seed=3)
    finally:
        torch.set_num_threads(threads)
    assert pair.steps == 24


def test_whole_step_only_where_it_applies(tiny_qwen3: str, tiny_lfm2: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_runner(tiny_qwen3, True).native_decode is not None
    assert make_runner(tiny_qwen3, True, cpu_linear="auto").native_decode is not None  # auto packs for our kernel
    assert make_runner(tiny_qwen3, True, cpu_linear="plain").native_decode is None  # MKL's layout
    assert make_runner(tiny_qwen3, True, cpu_linear="packed").native_decode is None  # oneDNN's layout
    assert make_runner(tiny_qwen3, True, mirror_mib=0).native_decode is None  # no mirror to attend over
    assert make_runner(tiny_lfm2, True).native_decode is None  # conv layers
    monkeypatch.setenv("PDC_NATIVE_DECODE_STEP", "0")
    assert make_runner(tiny_qwen3, True).native_decode is None


def test_head_left_to_torch_where_the_kernel_has_none(tiny_model_factory: Callable[..., str]) -> None:
    """A model whose head the kernel does not run (``Model.head`` null): the step returns the
    final norm's output and the model's own head makes the logits, which still match."""
    pair = Pair(tiny_model_factory("llama"))
    native = pair.native.native_decode
    assert native is not None and native.model_ends.head
    native.model_ends.head = None
    run_schedule(pair, seed=5)
    assert pair.steps == 24


def test_token_outside_the_embedding_fails_the_step_and_writes_nothing(tiny_qwen3: str) -> None:
    pair = Pair(tiny_qwen3)
    pair.admit(0, [5, 6, 7, 8, 9], budget=8)
    pair.step([0])
    kv = pair.kv[0][0]
    before = [t.clone() for t in pair.native.kv_pool.buffers()]
    with pytest.raises(ValueError, match="outside the embedding"):
        pair.native.decode([DecodeItem(kv.row, pair.vocab, kv.kv_len)])
    for now, then in zip(pair.native.kv_pool.buffers(), before):
        assert torch.equal(now, then)  # the id is checked before any K/V is written
    pair.step([0])  # the next step refills the lane the failed one reset, and agrees again
    pair.check_pools()
    pair.finish(0)
    pair.native.memory.check_integrity()
