"""Functional collectives (DTensor's, tensor parallelism's) are timed where they can be; a collective that ran
untimed gives its op no time at all (n/a), never a 0, in the record and in the comparison's table."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import pytest

from dist_train.compare.report import summary_table
from dist_train.compare.table import time_columns
from dist_train.telemetry.bandwidth import COMM_OPS
from dist_train.telemetry.comm import CommTracker, OpTotals, _Record
from dist_train.telemetry.comm_analysis import comm_keys, total_comm_s


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank in this process (the functional collectives need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _calls(group):  # noqa: ANN001, ANN202
    """The functional collectives DTensor issues, with non-zero gather/scatter dims as sequence parallelism's."""
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    return [
        ("all_reduce", lambda: funcol.all_reduce(x, "sum", group)),
        ("all_gather", lambda: funcol.all_gather_single(x, 1, group)),
        ("reduce_scatter", lambda: funcol.reduce_scatter_single(x, "sum", 1, group)),
    ]


def test_eager_functional_collectives_are_timed_and_return_what_torch_returns(one_rank_group):
    expected = [(op, funcol.wait_tensor(call())) for op, call in _calls(one_rank_group)]
    tracker = CommTracker().install()
    try:
        got = [(op, funcol.wait_tensor(call())) for op, call in _calls(one_rank_group)]
    finally:
        tracker.uninstall()  # waits for its watcher threads (gloo's reduce-scatter has no future)
    totals = tracker.drain()
    for (op, want), (_, have) in zip(expected, got):
        assert torch.equal(want, have) and want.shape == have.shape, op
        assert totals[op].count == 1 and totals[op].untimed == 0 and totals[op].timed_bytes == totals[op].bytes > 0
    keys = comm_keys(totals, 1)
    assert "comm/untimed_count" not in keys and all(f"comm/{op}/time_s" in keys for op in COMM_OPS)


def test_a_functional_collective_recording_autograd_is_torchs_own_counted_but_untimed(one_rank_group):
    x = torch.ones(4, requires_grad=True)
    tracker = CommTracker().install()
    try:
        out = funcol.wait_tensor(funcol.all_reduce(x * 2, "sum", one_rank_group))
        totals = tracker.drain()
    finally:
        tracker.uninstall()
    assert torch.equal(out.detach(), torch.full((4,), 2.0))
    assert totals["all_reduce"].count == 1 and totals["all_reduce"].untimed == 1
    assert totals["all_reduce"].timed_bytes == 0


def _totals(*, timed: int, untimed: int, seconds: float = 0.004) -> OpTotals:
    t = OpTotals()
    for i in range(timed + untimed):
        rec = _Record(op="all_reduce", nbytes=1000, group_size=2, start_s=0.0, dim="tp", untimed=i >= timed)
        t.add(rec, None if rec.untimed else seconds)
    return t


def test_an_op_with_untimed_calls_has_no_time_and_says_how_many():
    keys = comm_keys({"all_reduce": _totals(timed=2, untimed=4), "all_gather": OpTotals()}, 2)
    assert keys["comm/all_reduce/count"] == 3 and keys["comm/all_reduce/untimed_count"] == 2
    assert "comm/all_reduce/time_s" not in keys and "comm/tp/all_reduce/time_s" not in keys
    assert keys["comm/tp/all_reduce/untimed_count"] == 2 and keys["comm/untimed_count"] == 2
    assert keys["comm/all_reduce/busbw_gbps"] > 0  # of the two timed calls
    assert keys["comm/all_gather/time_s"] == 0.0  # never issued: 0 is true
    assert total_comm_s(keys) is None

    none_timed = comm_keys({"all_reduce": _totals(timed=0, untimed=3)}, 1)
    assert "comm/all_reduce/busbw_gbps" not in none_timed and "comm/all_reduce/time_s" not in none_timed

    timed = comm_keys({"all_reduce": _totals(timed=2, untimed=0), "all_gather": OpTotals()}, 2)
    assert timed["comm/all_reduce/time_s"] == pytest.approx(0.004) and total_comm_s(timed) == pytest.approx(0.004)
    assert "comm/untimed_count" not in timed and "comm/all_reduce/untimed_count" not in timed


def test_the_comparison_shows_na_not_zero_for_a_strategy_with_untimed_collectives():
    summary = {"mean_step_s": 0.5, "tokens_per_s": 100.0, "steps": 2, "steps_done": 2, "timing_warmup_steps": 0}
    untimed = [{"step": s, "rank": r, "comm/all_reduce/count": 43.0, "comm/all_reduce/untimed_count": 43.0,
                "comm/all_gather/time_s": 0.0} for s in (1, 2) for r in (0, 1)]
    cols = time_columns(summary, untimed)
    assert cols["comm_s"] is None and cols["compute_s"] is None and cols["comm_all_reduce_s"] is None
    timed = [{"step": s, "rank": r, "comm/all_reduce/time_s": 0.1} for s in (1, 2) for r in (0, 1)]
    assert time_columns(summary, timed)["comm_s"] == pytest.approx(0.1)

    row = {"strategy": "tp", "status": "ok", "world_size": 2, "step_s": 0.5, "tokens_per_s": 100.0,
           "comm_bytes_per_step": 0, "final_loss": 1.0, **cols}
    line = summary_table([row]).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:5] == ["500.0", "n/a", "n/a"]  # step ms, compute ms, comm ms
