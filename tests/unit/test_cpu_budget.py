"""The CPU thread budget: core lists, flag/env resolution, the split among a host's nodes, and the
scheduler process applying it (a real spawned process, as the node launcher spawns one)."""
from __future__ import annotations

import multiprocessing as mp

import pytest

from common.cpu_budget import (
    CpuBudgetError,
    CpuConfig,
    allowed_cpus,
    cpu_config,
    format_cpu_list,
    parse_cpu_list,
    split_threads,
)


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


def test_a_host_s_cores_are_divided_among_its_nodes() -> None:
    assert split_threads(2, cores=8) == 4
    assert split_threads(4, cores=2) == 1  # never zero
    assert split_threads(3, cores=8) == 2


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
