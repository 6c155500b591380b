"""The CPU thread budget: core lists, flag/env resolution, the split among a host's nodes, and the
scheduler process applying it (a real spawned process, as the node launcher spawns one)."""
from __future__ import annotations

import multiprocessing as mp

import pytest

from common.cpu_budget import (
    GPU_NODE_THREADS,
    CpuBudgetError,
    CpuConfig,
    allowed_cpus,
    cpu_config,
    format_cpu_list,
    parse_cpu_list,
    split_threads,
)
from common.tools.local_cluster import budget_args


def test_cpu_lists_parse_and_format() -> None:
    allowed = list(range(16))
    assert parse_cpu_list("0-3,8", allowed) == (0, 1, 2, 3, 8)
    assert parse_cpu_list(" 5 ", allowed) == (5,)
    assert format_cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"


@pytest.mark.parametrize("text, what", [("5-2", "ascending"), ("a", "not a core number"), ("0,0", "twice"),
                                        ("0-40", "not available"), ("-1", "not a core number")])
def test_bad_cpu_lists_are_refused_with_the_flag_named(text: str, what: str) -> None:
    with pytest.raises(CpuBudgetError, match=what) as exc:
        parse_cpu_list(text, list(range(16)))
    assert "--cpu-bind" in str(exc.value)


def test_resolution_flags_over_env_over_the_cores_available(monkeypatch: pytest.MonkeyPatch) -> None:
    n = len(allowed_cpus())
    monkeypatch.delenv("PDC_CPU_THREADS", raising=False)
    monkeypatch.delenv("PDC_CPU_BIND", raising=False)
    assert cpu_config(None, None) == CpuConfig(n, ())
    monkeypatch.setenv("PDC_CPU_THREADS", "3")
    assert cpu_config(None, None).threads == 3
    assert cpu_config(1, None).threads == 1  # the flag wins
    first = allowed_cpus()[0]
    monkeypatch.delenv("PDC_CPU_THREADS")
    assert cpu_config(None, str(first)) == CpuConfig(1, (first,))  # bound: as many threads as cores
    with pytest.raises(CpuBudgetError, match="more than the 1 cores"):
        cpu_config(2, str(first))
    with pytest.raises(CpuBudgetError, match=">= 0"):
        cpu_config(-1, None)


def test_a_gpu_node_defaults_to_one_thread_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDC_CPU_THREADS", raising=False)
    monkeypatch.delenv("PDC_CPU_BIND", raising=False)
    for device in ("cuda", "cuda:1"):
        assert cpu_config(None, None, device=device).threads == GPU_NODE_THREADS == 1
        assert cpu_config(0, None, device=device).threads == 1  # 0 is "auto", as on the CPU
        assert cpu_config(3, None, device=device).threads == 3  # the flag wins
    assert cpu_config(None, None, device="cpu").threads == len(allowed_cpus())
    monkeypatch.setenv("PDC_CPU_THREADS", "2")
    assert cpu_config(None, None, device="cuda").threads == 2  # so does the variable


def test_a_host_s_cores_are_divided_among_its_nodes() -> None:
    assert split_threads(2, cores=8) == 4
    assert split_threads(4, cores=2) == 1  # never zero
    assert split_threads(3, cores=8) == 2


def test_a_local_cluster_gives_shares_to_its_cpu_nodes_only() -> None:
    cores = len(allowed_cpus())
    # Both on the CPU: every rank a share, one share group.
    pre, dec = budget_args([], [], [1], [1, 2], {}, "g")
    each = split_threads(4)
    assert pre == [["--tp-size", "1", "--cpu-threads", str(each), "--cpu-share", "g"]]
    assert dec == [["--tp-size", "1", "--cpu-threads", str(each), "--cpu-share", "g"],
                   ["--tp-size", "2", "--cpu-threads", str(2 * each), "--cpu-share", "g"]]
    # The decode on a GPU (flag or variable): it takes no share and the prefill has the cores.
    for dargs, env in ((["--device", "cuda"], {}), (["--device=cuda:0"], {}), ([], {"PDC_DEVICE": "cuda"})):
        pre, dec = budget_args([], dargs, [1], [1], env, "g")
        assert dec == [["--tp-size", "1"]], (dargs, env)
        if "PDC_DEVICE" in env:  # the variable puts both on the GPU
            assert pre == [["--tp-size", "1"]]
        else:
            assert pre == [["--tp-size", "1", "--cpu-threads", str(cores)]]
    # An explicit "--device auto" defers to PDC_DEVICE, as the node's own resolution does.
    assert budget_args(["--device", "auto"], [], [1], [1], {"PDC_DEVICE": "cuda"}, "g") == (
        [["--tp-size", "1"]], [["--tp-size", "1"]])
    # The caller chose: no share given to anyone.
    assert budget_args(["--cpu-threads", "1"], [], [1], [1], {}, "g") == ([["--tp-size", "1"]], [["--tp-size", "1"]])
    assert budget_args([], [], [1], [1], {"PDC_CPU_THREADS": "1"}, "g") == ([["--tp-size", "1"]], [["--tp-size", "1"]])


def _child(cfg: CpuConfig, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import os

    from common.cpu_budget import apply_scheduler_budget

    apply_scheduler_budget(cfg)
    import torch

    out.put((torch.get_num_threads(), sorted(os.sched_getaffinity(0))))


def test_the_scheduler_process_takes_its_budget_before_any_work() -> None:
    first = allowed_cpus()[0]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_child, args=(CpuConfig(1, (first,)), out))
    p.start()
    threads, affinity = out.get(timeout=120)
    p.join(30)
    assert (threads, affinity) == (1, [first])
