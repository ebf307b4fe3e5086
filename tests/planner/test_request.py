"""PlanRequest: defaults and checks shared by plan_heuristic, plan_milp, lower_bound and PlanCache."""

from __future__ import annotations

import pytest

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import bound_parts, lower_bound, lower_bound_parts
from ds_recycle.planner.milp import plan_milp
from ds_recycle.planner.plan import CostModel
from ds_recycle.planner.request import PlanRequest


def test_defaults_and_failure_set() -> None:
    request = PlanRequest(3, 4, 5, [(2, 1), (0, 3), (2, 1)])
    assert request.failed == ((0, 3), (2, 1))
    assert request.costs == CostModel.uniform(4) and request.memory_cap == 4
    assert request.options == ScheduleOptions()
    assert request == PlanRequest(3, 4, 5, [(0, 3), (2, 1)], CostModel.uniform(4), 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 2, 2), "must all be >= 1"),
        ((2, 2, 2, (), CostModel.uniform(3)), "cost model has 3 stages"),
        ((2, 2, 2, (), None, 0), "memory_cap=0"),
    ],
)
def test_every_entry_point_refuses_the_same_way(args: tuple, message: str) -> None:
    for call in (PlanRequest, plan_heuristic, plan_milp, lower_bound):
        with pytest.raises(ValueError, match=message):
            call(*args)


def test_with_failed_is_the_same_request_for_another_failure_set() -> None:
    costs = CostModel.uniform(4, comm=0.5)
    request = PlanRequest(3, 4, 5, [(0, 1)], costs, 2, ScheduleOptions(decoupled=False))
    other = request.with_failed([(2, 3), (1, 0), (2, 3)])
    assert other == PlanRequest(3, 4, 5, [(1, 0), (2, 3)], costs, 2, ScheduleOptions(decoupled=False))
    assert request.failed == ((0, 1),)
    assert PlanCache().get_or_plan(other).failed == ((1, 0), (2, 3))


def test_the_bound_of_a_request_is_the_bound_of_its_parameters() -> None:
    costs = CostModel((1.0, 2.0, 1.5), (2.0, 2.0, 3.0), (1.0, 0.5, 1.0), 0.1, 0.2)
    request = PlanRequest(3, 3, 6, [(1, 1)], costs, 2)
    assert bound_parts(request) == lower_bound_parts(3, 3, 6, [(1, 1)], costs, 2)
    assert plan_heuristic(3, 3, 6, [(1, 1)], costs, 2).lower_bound == bound_parts(request).value
