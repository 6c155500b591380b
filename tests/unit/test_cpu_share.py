"""The core board co-located nodes share (common/cpu_share.py): a decode step takes the cores nobody
else is running a forward on, a prefill keeps its base, a dead node's claim is void."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from common.cpu_budget import CpuBudgetError, cpu_config
from common.cpu_share import SLOTS, CoreBoard, CoreShareError, board_path, check_group, open_board


@pytest.fixture
def path(tmp_path) -> str:
    return str(tmp_path / "board")


def board(path: str, role: str, calls: list[int] | None = None, threads: int = 1, cores: int = 2) -> CoreBoard:
    return CoreBoard(path, role=role, threads=threads, cores=cores, borrow=role == "decode",
                     set_threads=(calls.append if calls is not None else lambda n: None))


def test_a_decode_step_borrows_the_cores_an_idle_prefill_lends(path: str) -> None:
    calls: list[int] = []
    decode, prefill = board(path, "decode", calls), board(path, "prefill")
    try:
        assert decode.slot != prefill.slot
        with decode.forward() as n:
            assert n == 2
            assert prefill.neighbours_threads() == 2  # the claim is visible while the step runs
        assert prefill.neighbours_threads() == 0  # and gone after it
        with prefill.forward() as m:
            assert m == 1
            with decode.forward() as n:
                assert n == 1  # the prefill's core is busy: back to the base
        with decode.forward() as n:
            assert n == 2
        assert calls == [2, 1, 2]  # the pool is resized only when the count changes
        with decode.forward():
            pass
        assert calls == [2, 1, 2] and decode.borrowed_steps == 3
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_waits_for_a_borrowed_step_to_end_before_its_forward(path: str, monkeypatch) -> None:
    """A prefill starting while the decode runs a borrowed step (both cores) claims its core, waits
    for the step to end (no two teams on one core), and the decode's next step sees the claim and
    runs at its base. The wait is bounded: a step that never ends does not hold the prefill."""
    import threading
    import time

    import common.cpu_share as cpu_share

    decode, prefill = board(path, "decode"), board(path, "prefill")
    order: list[str] = []
    try:
        with decode.forward() as n:
            assert n == 2
            started = threading.Event()

            def run_prefill() -> None:
                started.set()
                with prefill.forward() as m:
                    order.append(f"prefill {m}")
                    with decode.forward() as k:  # the decode's next step, during the prefill's forward
                        order.append(f"decode {k}")

            t = threading.Thread(target=run_prefill)
            t.start()
            started.wait(5)
            time.sleep(0.03)
            assert decode.neighbours_threads() == 1  # the claim is written before the wait
            order.append("decode step ends")
        t.join(5)
        assert order == ["decode step ends", "prefill 1", "decode 1"]
        assert prefill.waits == 1 and 0.02 < prefill.wait_seconds < cpu_share.LENDER_WAIT_S + 0.05
        monkeypatch.setattr(cpu_share, "LENDER_WAIT_S", 0.05)
        with decode.forward() as n:  # a step that outlasts the bound
            assert n == 2
            t0 = time.monotonic()
            with prefill.forward() as m:
                assert m == 1 and time.monotonic() - t0 < 1.0
        assert prefill.waits == 2
        with prefill.forward():  # nobody borrowing: no wait at all
            pass
        assert prefill.waits == 2
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_keeps_its_base_even_when_the_decode_is_idle(path: str) -> None:
    calls: list[int] = []
    decode, prefill = board(path, "decode"), board(path, "prefill", calls, threads=2, cores=4)
    try:
        with prefill.forward() as m:
            assert m == 2
            with decode.forward() as n:
                assert n == 1  # 2 cores left of 4 on the decode's side (cores=2 there): its base
        assert calls == [] and prefill.borrowed_steps == 0
    finally:
        decode.close()
        prefill.close()


def test_two_decodes_fall_back_to_their_base_while_their_steps_overlap(path: str) -> None:
    a, b = board(path, "decode"), board(path, "decode")
    try:
        with a.forward() as n:
            assert n == 2
            with b.forward() as m:
                assert m == 1  # sees a's 2 threads: nothing left to borrow
        with b.forward() as m:
            assert m == 2  # steps that do not overlap each get every core
    finally:
        a.close()
        b.close()


def test_a_dead_nodes_claim_is_void_and_its_slot_is_taken_again(path: str) -> None:
    # A node that dies inside a forward leaves its claim written; its lock dies with it.
    code = textwrap.dedent(f"""
        import sys, time
        from common.cpu_share import CoreBoard
        b = CoreBoard({path!r}, role="prefill", threads=1, cores=2, borrow=False, set_threads=lambda n: None)
        with b.forward():
            print(b.slot, flush=True)
            time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        child_slot = int(child.stdout.readline())  # type: ignore[union-attr]
        decode = board(path, "decode")
        try:
            assert decode.neighbours_threads() == 1 and decode.plan() == 1
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
            assert decode.neighbours_threads() == 0 and decode.plan() == 2  # claim still written, owner gone
            again = board(path, "prefill")
            try:
                assert again.slot == child_slot  # the first free slot: the dead node's
                assert decode.neighbours_threads() == 0  # its claim was reset on taking the slot
            finally:
                again.close()
        finally:
            decode.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
        child.stdout.close()  # type: ignore[union-attr]


def test_a_closed_board_frees_its_slot_and_a_full_board_is_refused(path: str) -> None:
    boards = [board(path, "prefill") for _ in range(SLOTS)]
    try:
        assert sorted(b.slot for b in boards) == list(range(SLOTS))
        with pytest.raises(CoreShareError, match="all 64 slots"):
            board(path, "decode")
        boards[5].close()
        boards[5].close()  # twice is harmless
        late = board(path, "decode")
        assert late.slot == 5
        boards[5] = late
    finally:
        for b in boards:
            b.close()


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "sp ace", "..\x00"])
def test_a_bad_group_name_is_refused_by_the_flag(name: str) -> None:
    if name:
        with pytest.raises(CpuBudgetError, match="--cpu-share"):
            cpu_config(1, None, name)
    with pytest.raises(CoreShareError):
        check_group(name)


def test_the_group_from_flag_or_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDC_CPU_SHARE", "from-env")
    assert cpu_config(1, None).share == "from-env"
    assert cpu_config(1, None, "flag.wins").share == "flag.wins"
    assert cpu_config(1, None, "").share == ""  # an empty flag turns it off
    monkeypatch.setenv("PDC_CPU_SHARE_DIR", str(tmp_path))
    assert board_path("g1") == str(tmp_path / "pdcluster-cpu-g1")


def test_open_board_applies_to_single_rank_cpu_nodes_only(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDC_CPU_SHARE_DIR", str(tmp_path))
    kw = dict(role="decode", threads=1, cores=2)
    assert open_board("", device="cpu", tp_size=1, **kw) is None
    assert open_board("g", device="cuda:0", tp_size=1, **kw) is None
    assert open_board("g", device="cpu", tp_size=2, **kw) is None
    b = open_board("g", device="cpu", tp_size=1, **kw)
    plain = open_board("g", device="cpu", tp_size=1, splits=False, **kw)  # MKL projections: no borrowing
    try:
        assert b is not None and b.borrow and b.as_dict()["board"] == str(tmp_path / "pdcluster-cpu-g")
        assert plain is not None and not plain.borrow and plain.plan() == 1
        with plain.forward():
            assert b.neighbours_threads() == 1  # it still claims what it runs
    finally:
        b.close()  # type: ignore[union-attr]
        plain.close()  # type: ignore[union-attr]
    monkeypatch.setenv("PDC_CPU_SHARE_DIR", str(tmp_path / "missing"))
    assert open_board("g", device="cpu", tp_size=1, **kw) is None  # logged; the node runs at its base


def test_the_engine_driver_claims_its_threads_for_each_forward(path: str) -> None:
    import torch

    from common.engine.driver import EngineDriver, SampleSpec
    from common.engine.sampler import Sampler
    from common.parallel import SINGLE_RANK
    from common.request import SamplingParams

    decode, prefill = board(path, "decode"), board(path, "prefill")
    seen: list[tuple[str, int]] = []

    class Runner:  # what the driver calls: one forward, logits for each row
        tp = SINGLE_RANK

        def extend(self, chunks):
            seen.append(("extend", decode.neighbours_threads()))
            return torch.tensor([[0.0, 1.0]] * len(chunks))

        def decode(self, items):
            seen.append(("decode", prefill.neighbours_threads()))
            return torch.tensor([[1.0, 0.0]] * len(items))

    try:
        spec = SampleSpec(SamplingParams(temperature=0.0), [])
        assert [t.token_id for t in EngineDriver(Runner(), Sampler(), prefill).run_extend([None], [spec])] == [1]
        assert [t.token_id for t in EngineDriver(Runner(), Sampler(), decode).run_decode([None, None], [spec, spec])] == [0, 0]
        assert seen == [("extend", 1), ("decode", 2)]  # each claim held during its forward ...
        assert decode.neighbours_threads() == 0 and prefill.neighbours_threads() == 0  # ... and only then
    finally:
        decode.close()
        prefill.close()
