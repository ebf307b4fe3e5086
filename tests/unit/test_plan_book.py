"""The plan book: a plan per (failure set, costs, memory budget, micro-batches), made once and
never cleared by hand; the memory cap enforced; predictions on the inputs in use."""

import math

import pytest

from ds_recycle.engine.memory_cap import MemoryBudget, StageMemory, peak_in_flight
from ds_recycle.engine.plan_book import PlanBook
from ds_recycle.errors import MemoryCapError
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import CostModel
from ds_recycle.planner.request import PlanRequest
from ds_recycle.planner.validator import validate

D, P, M = 2, 3, 4
UNIT = CostModel.uniform(P)
SLOW_LAST = CostModel((1.0, 1.0, 3.0), (1.0, 1.0, 3.0), (1.0, 1.0, 3.0))


def book(worker=(0, 1)) -> PlanBook:
    plans = PlanBook(D, P, worker, ScheduleOptions(), prefetch=False)
    plans.switch((), UNIT, None, M)
    return plans


def test_each_input_change_takes_its_plan_and_a_change_back_finds_the_first_without_clearing():
    plans = book()
    fault_free, fault_free_stream = plans.plan, plans.stream
    assert not plans.plan.failed and not plans.prefetched
    plans.switch(failed=[(1, 1)])
    degraded = plans.plan
    assert degraded.failed == ((1, 1),) and degraded.costs == UNIT
    validate(degraded)
    plans.switch(costs=SLOW_LAST)
    assert plans.plan.costs == SLOW_LAST and plans.plan.failed == ((1, 1),)
    assert plans.plan.iteration_time > degraded.iteration_time
    plans.switch(failed=(), costs=UNIT)
    assert plans.plan is fault_free and plans.stream is fault_free_stream
    plans.switch(failed=[(1, 1)])
    assert plans.plan is degraded


def test_the_fault_free_time_follows_the_costs_in_use():
    plans = book()
    unit = plans.fault_free_time()
    plans.switch(costs=SLOW_LAST)
    assert plans.fault_free_time() > unit
    plans.switch(costs=UNIT)
    assert plans.fault_free_time() == unit


def test_a_plan_met_before_its_failure_set_arose_counts_as_prefetched():
    plans = book()
    plans.cache.get_or_plan(PlanRequest(D, P, M, [(0, 2)], UNIT, None, ScheduleOptions()))
    plans.switch(failed=[(0, 2)])
    assert plans.prefetched and plans.summary((2, 2, 1)).prefetched
    plans.switch(failed=[(0, 2), (1, 0)])
    assert not plans.prefetched


def test_a_budget_that_holds_two_micro_batches_caps_every_plan_and_one_that_holds_none_stops():
    plans = book()
    two = MemoryBudget(tuple(StageMemory(100, 1000, 1250) for _ in range(P)))
    plans.switch(budget=two)
    assert max(peak_in_flight(plans.plan).values()) <= 2
    plans.switch(failed=[(1, 1)])
    assert max(peak_in_flight(plans.plan).values()) <= 2 and plans.plan.memory_cap == 2
    none = MemoryBudget((StageMemory(100, 1000, 5000), StageMemory(100, 1000, 1050), StageMemory(100, 1000, 5000)))
    with pytest.raises(MemoryCapError, match=r"failure set \[\(1, 1\)\] cannot fit in memory: memory cap 0") as error:
        plans.switch(budget=none)
    assert "stage 1 needs 1000 static + 1 x 100 bytes = 1100 bytes of its 1050" in str(error.value)
    assert plans.plan.memory_cap == 2, "a switch that fails keeps the plan in use"
    fault_free_over_the_limit = book()
    fault_free_over_the_limit.switch(budget=none)
    assert not fault_free_over_the_limit.plan.failed
    assert math.isinf(fault_free_over_the_limit.predicted_time([(0, 0)]))


def test_an_evaluation_from_an_iterator_keeps_a_straggler_on_its_own_micro_batches():
    plans = book(worker=(1, 2))
    plans.switch(costs=CostModel(UNIT.F, UNIT.B, UNIT.W, slow=((1, 2, 3.0),)))
    routed = plans.evaluation_stream(M, any_worker_loads=True)
    own = plans.evaluation_stream(M, any_worker_loads=False)
    assert plans.foreign_loads(own) == []
    assert plans.evaluation_stream(M, any_worker_loads=False) is own
    assert sum(len(s.actions) for s in routed.values()) == sum(len(s.actions) for s in own.values())
