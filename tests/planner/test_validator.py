"""The validator catches each kind of broken plan, one test per rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.plan import CostModel, Op, Plan
from ds_recycle.planner.validator import PlanError, validate


def _copy(plan: Plan) -> Plan:
    return replace(plan, workers={w: list(ops) for w, ops in plan.workers.items()}, extra=dict(plan.extra))


def _refresh(plan: Plan) -> Plan:
    plan.iteration_time = max(op.end for ops in plan.workers.values() for op in ops)
    return plan


def _find(plan: Plan, kind: str, home: int, mb: int, stage: int) -> tuple[tuple[int, int], int]:
    for worker, ops in plan.workers.items():
        for i, op in enumerate(ops):
            if (op.kind, op.home, op.mb, op.stage) == (kind, home, mb, stage):
                return worker, i
    raise KeyError((kind, home, mb, stage))


def _move(plan: Plan, worker, index: int, start: float) -> Plan:
    out = _copy(plan)
    op = out.workers[worker][index]
    out.workers[worker][index] = op._replace(start=start, end=start + (op.end - op.start))
    return _refresh(out)


@pytest.fixture
def plan() -> Plan:
    return fault_free_plan(2, 3, 4)


def test_good_plans_pass(plan):
    validate(plan)
    validate(plan_heuristic(3, 3, 4, [(0, 1), (2, 2)]))
    validate(plan_heuristic(2, 3, 3, [(1, 0)], costs=CostModel((1, 2, 1), (2, 1, 2), (1, 1, 3), comm=0.5, step=2)))


def test_missing_op(plan):
    worker, i = _find(plan, "W", 1, 2, 1)
    del plan.workers[worker][i]
    with pytest.raises(PlanError, match=r"W\(h=1,k=2,s=1\): missing"):
        validate(_refresh(plan))


def test_duplicate_op(plan):
    worker, i = _find(plan, "F", 0, 0, 0)
    plan.workers[(1, 0)].append(plan.workers[worker][i])
    with pytest.raises(PlanError, match=r"F\(h=0,k=0,s=0\).*duplicate"):
        validate(_refresh(plan))


def test_f_b_w_on_different_workers(plan):
    worker, i = _find(plan, "W", 1, 3, 2)
    op = plan.workers[worker].pop(i)
    ops = plan.workers[(0, 2)]
    ops.insert(len(ops) - 1, op._replace(start=ops[-2].end, end=ops[-2].end + 1))
    with pytest.raises(PlanError, match=r"W\(h=1,k=3,s=2\) on worker \(0, 2\): F, B and W of one \(h,k,s\) must share"):
        validate(_refresh(plan))


def test_op_on_failed_worker(plan):
    plan.failed = ((1, 1),)
    with pytest.raises(PlanError, match=r"worker \(1, 1\): runs on a failed worker"):
        validate(plan)


def test_failed_worker_outside_grid(plan):
    plan.failed = ((5, 0),)
    with pytest.raises(PlanError, match="outside"):
        validate(plan)


def test_live_worker_without_ops(plan):
    del plan.workers[(1, 2)]
    with pytest.raises(PlanError, match=r"\(1, 2\).*no op list"):
        validate(plan)


def test_stage_mismatch(plan):
    ops = plan.workers[(0, 1)]
    ops[0] = ops[0]._replace(stage=2)
    with pytest.raises(PlanError, match=r"op.stage 2 differs from the worker's stage 1"):
        validate(plan)


def test_duration_mismatch(plan):
    ops = plan.workers[(0, 1)]
    ops[0] = ops[0]._replace(end=ops[0].end + 0.5)
    with pytest.raises(PlanError, match=r"F\(h=0,k=0,s=1\).*duration"):
        validate(plan)


def test_not_in_start_order(plan):
    ops = plan.workers[(0, 0)]
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(PlanError, match="start order"):
        validate(plan)


def test_overlap(plan):
    ops = plan.workers[(0, 0)]
    assert ops[1].start == ops[0].end
    with pytest.raises(PlanError, match=r"F\(h=0,k=1,s=0\).*overlaps F\(h=0,k=0,s=0\)"):
        validate(_move(plan, (0, 0), 1, ops[0].start + 0.5))


def test_forward_follows_previous_stage(plan):
    worker, i = _find(plan, "F", 0, 0, 1)
    assert i == 0
    with pytest.raises(PlanError, match=r"F\(h=0,k=0,s=1\).*F must follow F of the previous stage"):
        validate(_move(plan, worker, 0, 0.5))


def test_forward_waits_for_comm():
    costs = CostModel.uniform(2, comm=0.5)
    plan = fault_free_plan(1, 2, 2, costs)
    validate(plan)
    worker, i = _find(plan, "F", 0, 0, 1)
    assert plan.workers[worker][i].start == 1.5
    with pytest.raises(PlanError, match=r"F\(h=0,k=0,s=1\).*\+ comm 0.5"):
        validate(_move(plan, worker, i, 1.0))


def test_backward_follows_next_stage(plan):
    worker, i = _find(plan, "B", 0, 0, 0)
    ops = plan.workers[worker]
    assert ops[i].start > ops[i - 1].end  # stage 0 waits for the gradient
    with pytest.raises(PlanError, match=r"B\(h=0,k=0,s=0\).*B must follow B of the next stage"):
        validate(_move(plan, worker, i, ops[i - 1].end))


def test_last_stage_backward_follows_own_forward(plan):
    worker, i = _find(plan, "F", 0, 0, 2)
    ops = plan.workers[worker]
    f, b = ops[i], ops[i + 1]
    assert b.kind == "B" and (b.home, b.mb) == (0, 0)
    ops[i] = b._replace(start=f.start, end=f.start + (b.end - b.start))
    ops[i + 1] = f._replace(start=ops[i].end, end=ops[i].end + (f.end - f.start))
    with pytest.raises(PlanError, match=r"B\(h=0,k=0,s=2\).*B must follow its own F"):
        validate(_refresh(plan))


def test_weight_follows_backward(plan):
    for _worker, ops in plan.workers.items():
        for i in range(len(ops) - 1):
            b, w = ops[i], ops[i + 1]
            if b.kind == "B" and w.kind == "W" and (b.home, b.mb) == (w.home, w.mb):
                ops[i] = w._replace(start=b.start, end=b.start + (w.end - w.start))
                ops[i + 1] = b._replace(start=ops[i].end, end=ops[i].end + (b.end - b.start))
                with pytest.raises(PlanError, match=rf"W\(h={w.home},k={w.mb},s={w.stage}\).*W must follow its B"):
                    validate(_refresh(plan))
                return
    pytest.fail("no B directly followed by its W in the plan")


def test_step_follows_every_weight_of_the_stage(plan):
    ops = plan.workers[(1, 1)]
    # delay worker (1, 1)'s last W and its S: worker (0, 1) now steps too early
    ops[-2] = ops[-2]._replace(start=ops[-2].start + 5, end=ops[-2].end + 5)
    ops[-1] = ops[-1]._replace(start=ops[-2].end, end=ops[-2].end + (ops[-1].end - ops[-1].start))
    with pytest.raises(PlanError, match=r"S\(stage 1\) on worker \(0, 1\): S must follow every W of stage 1"):
        validate(_refresh(plan))


def test_exactly_one_step(plan):
    step = plan.workers[(0, 2)].pop()
    with pytest.raises(PlanError, match=r"\(0, 2\): each live worker needs exactly one S, found 0"):
        validate(_refresh(plan))
    plan.workers[(0, 2)].extend([step, step._replace(start=step.end, end=step.end + (step.end - step.start))])
    with pytest.raises(PlanError, match="exactly one S, found 2"):
        validate(_refresh(plan))


def test_step_fields(plan):
    ops = plan.workers[(0, 0)]
    ops[-1] = ops[-1]._replace(home=0)
    with pytest.raises(PlanError, match="home == mb == -1"):
        validate(plan)


def test_microbatch_outside_topology(plan):
    ops = plan.workers[(0, 0)]
    ops[0] = Op("F", 0, 9, 0, ops[0].start, ops[0].end)
    with pytest.raises(PlanError, match=r"F\(h=0,k=9,s=0\).*outside"):
        validate(plan)


def test_memory_cap(plan):
    validate(plan)
    plan.memory_cap = 1
    with pytest.raises(
        PlanError, match=r"on worker \(\d, 0\): memory cap: 2 micro-batches held between F and W, cap is 1"
    ):
        validate(plan)


def test_iteration_time_matches_makespan(plan):
    plan.iteration_time += 1
    with pytest.raises(PlanError, match="iteration_time"):
        validate(plan)


def test_json_round_trip_still_valid(plan):
    again = Plan.from_json(plan.to_json())
    assert again == plan
    validate(again)
