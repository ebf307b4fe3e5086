"""The engine's fault-free schedule, as pure data: memory bound and stream well-formedness."""

from __future__ import annotations

import pytest

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lowering import check_streams, lower
from ds_recycle.planner.plan import CostModel


@pytest.mark.parametrize(("pipelines", "stages", "microbatches"), [(2, 2, 4), (1, 4, 8), (3, 2, 4), (2, 4, 16)])
@pytest.mark.parametrize("decoupled", [True, False])
def test_buffers_never_exceed_stock_1f1b_peak(pipelines, stages, microbatches, decoupled):
    """Stock 1F1B holds at most P micro-batches on any worker (stage 0); so does ReCycle."""
    plan = fault_free_plan(pipelines, stages, microbatches, options=ScheduleOptions(decoupled=decoupled))
    streams = lower(plan)
    check_streams(streams)
    for worker, stream in streams.items():
        assert stream.num_buffers <= min(stages, microbatches), worker
        held, peak = 0, 0
        for op in plan.workers[worker]:
            held += {"F": 1, "W": -1}.get(op.kind, 0)
            peak = max(peak, held)
        assert peak <= stages


def test_decoupled_schedule_beats_fused_1f1b_under_unit_costs():
    costs = CostModel.uniform(4)
    split = fault_free_plan(1, 4, 8, costs, options=ScheduleOptions(decoupled=True))
    fused = fault_free_plan(1, 4, 8, costs, options=ScheduleOptions(decoupled=False))
    assert split.iteration_time < fused.iteration_time
