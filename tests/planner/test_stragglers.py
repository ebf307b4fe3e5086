"""Stragglers in the planner: a worker of a cost model's ``slow`` list hands part of its
micro-batches to its stage's peers (a capacity below 1), the same re-routing as a failure."""

from __future__ import annotations

import pytest

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import balanced_give, plan_heuristic, reroute_assignment
from ds_recycle.planner.lowering import lower
from ds_recycle.planner.plan import FORWARD, CostModel
from ds_recycle.planner.request import PlanRequest
from ds_recycle.planner.validator import validate

BASE = CostModel((1.2, 1.0, 1.0, 1.6), (1.2, 1.0, 1.0, 1.6), (0.72, 0.6, 0.6, 0.96))


def slow(costs: CostModel, *entries: tuple[int, int, float]) -> CostModel:
    return CostModel(costs.F, costs.B, costs.W, costs.comm, costs.step, entries)


def test_cost_model_without_stragglers_keeps_its_dict():
    assert "slow" not in BASE.to_dict()
    model = slow(BASE, (1, 3, 2.0))
    assert CostModel.from_dict(model.to_dict()) == model
    assert model.op_duration("F", (1, 3)) == pytest.approx(3.2)
    assert model.op_duration("F", (0, 3)) == pytest.approx(1.6)
    assert model.op_duration("S", (1, 3)) == model.step
    assert model.without_stragglers() == BASE
    with pytest.raises(ValueError, match="factor"):
        slow(BASE, (0, 0, 0.0))
    with pytest.raises(ValueError, match="named twice"):
        slow(BASE, (0, 0, 2.0), (0, 0, 3.0))


def test_a_straggler_hands_evenly_spread_micro_batches_to_its_peers():
    D, P, m = 4, 2, 8
    assignment = reroute_assignment(D, P, m, (), give={(1, 1): 3})
    kept = [k for k in range(m) if assignment[(1, k, 1)] == 1]
    assert len(kept) == m - 3
    assert all(assignment[(1, k, 0)] == 1 for k in range(m))  # only the straggler's stage moves
    receivers = [assignment[(1, k, 1)] for k in range(m) if k not in kept]
    assert sorted(receivers) == [0, 2, 3]
    # with a failure at the same stage, the dead worker's micro-batches avoid the straggler
    both = reroute_assignment(D, P, m, [(2, 1)], give={(1, 1): 2})
    assert all(both[(2, k, 1)] in (0, 3) for k in range(m))
    assert balanced_give(4, 8, 2.0, 4) == pytest.approx(8 - 32 / 7)
    assert balanced_give(4, 8, 1.0, 4) == 0.0


@pytest.mark.parametrize("worker", [(1, 3), (2, 1), (0, 0)])
def test_a_2x_straggler_is_planned_around(worker):
    D, P, m = 4, 4, 8
    costs = slow(BASE, (*worker, 2.0))
    plan = plan_heuristic(D, P, m, (), costs=costs)
    validate(plan)
    lower(plan)
    nothing = fault_free_plan(D, P, m, costs=costs)
    fault_free = fault_free_plan(D, P, m, costs=BASE)
    assert plan.iteration_time < nothing.iteration_time - 1e-9
    # at best the stage has D - 1 + 1/2 workers of capacity: 4 / 3.5 = 1.14 where it is the bottleneck
    assert plan.iteration_time <= 1.25 * fault_free.iteration_time
    give = plan.extra["give"][f"{worker[0]},{worker[1]}"]
    forwards = [op for op in plan.workers[worker] if op.kind == FORWARD]
    assert len(forwards) == m - give > 0
    every = sorted((op.home, op.mb, op.stage) for ops in plan.workers.values() for op in ops if op.kind == FORWARD)
    assert every == sorted((h, k, s) for h in range(D) for k in range(m) for s in range(P))


def test_a_mild_straggler_whose_slowness_hides_keeps_its_work():
    # stage 2 has bubbles behind the slower last stage: 1.2x there costs nothing, so nothing moves
    plan = plan_heuristic(4, 4, 8, (), costs=slow(BASE, (1, 2, 1.2)))
    assert "give" not in plan.extra


def test_straggler_plans_are_cached_under_the_callers_labels():
    cache = PlanCache()
    costs = slow(BASE, (3, 1, 2.0))
    first = cache.get_or_plan(PlanRequest(4, 4, 8, [(0, 2)], costs))
    again = cache.get_or_plan(PlanRequest(4, 4, 8, [(0, 2)], costs))
    assert (cache.misses, cache.hits) == (1, 1)
    assert again.workers == first.workers
    assert (0, 2) not in first.workers and (3, 1) in first.workers
    validate(first)
    assert "3,1" in first.extra["give"]
