"""The heuristic planner, normalization, lower bound and cache."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import survivable_failures
from streams import check_lowering

from ds_recycle.planner.cache import PlanCache, canonical_failure_sets
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic, reroute_assignment
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import NoSurvivorError, lower_bound
from ds_recycle.planner.normalize import canonical, invert, relabel
from ds_recycle.planner.plan import CostModel, Plan
from ds_recycle.planner.request import PlanRequest
from ds_recycle.planner.validator import validate


def _check(plan: Plan) -> Plan:
    validate(plan)
    check_lowering(plan)
    assert plan.lower_bound == pytest.approx(
        lower_bound(plan.pipelines, plan.stages, plan.microbatches, plan.failed, plan.costs, plan.memory_cap)
    )
    assert plan.iteration_time >= plan.lower_bound - 1e-9
    assert plan.ratio >= 1 - 1e-12
    assert 0 < plan.steady_state_period <= plan.iteration_time + 1e-9
    assert plan.solver == "heuristic" and plan.solve_seconds > 0
    return plan


@st.composite
def cases(draw):
    D = draw(st.integers(2, 4))
    P = draw(st.integers(1, 5))
    m = draw(st.integers(1, 8))
    kept = draw(survivable_failures(D, P, max_size=D + 1))
    unit = draw(st.booleans())
    if unit:
        costs = CostModel.uniform(P)
    else:
        durations = st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=P, max_size=P).map(tuple)
        costs = CostModel(
            draw(durations),
            draw(durations),
            draw(durations),
            comm=draw(st.sampled_from([0.0, 0.1, 0.5])),
            step=draw(st.sampled_from([0.0, 1.0])),
        )
    cap = draw(st.sampled_from([None, 1, 2, P + 2]))
    options = ScheduleOptions(decoupled=draw(st.booleans()), staggered=draw(st.booleans()))
    return D, P, m, kept, costs, cap, options


@settings(max_examples=60, deadline=None)
@given(cases())
def test_heuristic_plans_are_valid(case):
    D, P, m, failed, costs, cap, options = case
    plan = _check(plan_heuristic(D, P, m, failed, costs, cap, options))
    assert set(plan.failed) == set(failed)
    assert set(plan.workers) == {(p, s) for p in range(D) for s in range(P)} - set(failed)
    assert plan.memory_cap == (P if cap is None else cap)


@settings(max_examples=25, deadline=None)
@given(cases(), st.randoms(use_true_random=False))
def test_relabelled_failure_sets_give_equal_plans(case, rnd):
    D, P, m, failed, costs, cap, options = case
    mapping = list(range(D))
    rnd.shuffle(mapping)
    moved = [(mapping[p], s) for p, s in failed]
    assert canonical(D, P, failed)[0] == canonical(D, P, moved)[0]
    a = plan_heuristic(D, P, m, failed, costs, cap, options)
    b = plan_heuristic(D, P, m, moved, costs, cap, options)
    assert a.iteration_time == b.iteration_time
    assert a.steady_state_period == b.steady_state_period
    # the relabelled plan is a valid plan for the relabelled set, as good as the one made for it
    a_moved = relabel(a, mapping)
    assert set(a_moved.failed) == set(moved)
    validate(a_moved)
    check_lowering(a_moved)
    check_lowering(b)
    assert a_moved.iteration_time == b.iteration_time


def test_canonical_distinguishes_shapes():
    same_pipeline = canonical(3, 4, [(0, 1), (0, 2)])[0]
    two_pipelines = canonical(3, 4, [(0, 1), (1, 2)])[0]
    assert same_pipeline != two_pipelines
    assert canonical(3, 4, [(2, 1), (2, 2)])[0] == same_pipeline
    assert canonical(3, 4, [(2, 2), (0, 1)])[0] == two_pipelines
    key, permutation = canonical(3, 4, [(2, 3)])
    assert key == ((0, 3),) and permutation[2] == 0 and sorted(permutation) == [0, 1, 2]
    assert invert(permutation)[0] == 2
    with pytest.raises(ValueError, match="outside"):
        canonical(3, 4, [(3, 0)])


def test_reroute_spreads_work_evenly():
    D, P, m = 4, 3, 8
    failed = [(0, 1), (1, 1), (2, 2)]
    assignment = reroute_assignment(D, P, m, failed)
    for s in range(P):
        loads = {p: 0 for p in range(D)}
        for (_h, _k, stage), p in assignment.items():
            if stage == s:
                loads[p] += 1
        dead = {p for p, q in failed if q == s}
        assert all(loads[p] == 0 for p in dead)
        alive = [loads[p] for p in range(D) if p not in dead]
        assert sum(alive) == D * m and max(alive) - min(alive) <= 1
    # live workers keep their own micro-batches
    assert all(assignment[(h, k, s)] == h for (h, k, s) in assignment if (h, s) not in set(failed))


def test_fault_free_matches_zb_h1():
    plan = _check(plan_heuristic(1, 4, 8))
    assert plan.iteration_time == 27  # ZB-H1: 3m + P - 1 with unit costs
    for D, P, m in [(1, 4, 8), (2, 4, 4), (1, 8, 8), (2, 3, 9)]:
        engine_plan = fault_free_plan(D, P, m)  # what the engine runs
        validate(engine_plan)
        check_lowering(engine_plan)
        assert engine_plan.iteration_time == 3 * m + P - 1 == lower_bound(D, P, m, ())


def test_single_failure_reaches_the_bound_on_a_simple_case():
    plan = _check(plan_heuristic(8, 8, 8, [(0, 4)]))
    assert plan.iteration_time == pytest.approx(plan.lower_bound)


def test_lower_bound_properties():
    P, m = 4, 8
    assert lower_bound(1, P, m, ()) == 27
    assert lower_bound(2, P, m, ()) == 27
    costs = CostModel((1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 3), comm=0.5, step=1)
    base = lower_bound(3, P, m, (), costs)
    rng = random.Random(0)
    workers = [(p, s) for p in range(3) for s in range(P)]
    for _ in range(30):
        failed = []
        previous = base
        for w in rng.sample(workers, 6):
            if sum(1 for _p, s in failed if s == w[1]) == 2:
                continue
            failed.append(w)
            bound = lower_bound(3, P, m, failed, costs)
            assert bound >= previous - 1e-12  # more failures never lower the bound
            previous = bound
    # the re-routed work shows: one of two survivors... a lone survivor does twice the work
    assert lower_bound(2, P, m, [(0, 3)]) >= 3 + 2 * m * 3


def test_every_plan_is_above_the_bound_on_a_grid():
    for D, P, m in [(2, 4, 4), (3, 4, 8), (4, 3, 6)]:
        for failed in canonical_failure_sets(D, P, 2):
            for cap in (None, 2):
                plan = plan_heuristic(D, P, m, failed, memory_cap=cap)
                validate(plan)
                check_lowering(plan)
                assert plan.iteration_time >= plan.lower_bound - 1e-9


def test_no_survivor_needs_checkpoint():
    with pytest.raises(NoSurvivorError, match="needs checkpoint fallback"):
        plan_heuristic(2, 4, 4, [(0, 2), (1, 2)])
    with pytest.raises(NoSurvivorError, match="stage 1.*needs checkpoint fallback"):
        lower_bound(3, 4, 4, [(0, 1), (1, 1), (2, 1)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="memory_cap=0"):
        plan_heuristic(2, 4, 4, [(0, 1)], memory_cap=0)
    with pytest.raises(ValueError, match="outside"):
        plan_heuristic(2, 4, 4, [(2, 1)])
    with pytest.raises(ValueError, match="cost model has 3 stages"):
        plan_heuristic(2, 4, 4, [], costs=CostModel.uniform(3))


def test_memory_cap_is_respected_when_tight():
    for cap in (1, 2, 3):
        plan = _check(plan_heuristic(3, 4, 8, [(0, 0), (1, 3)], memory_cap=cap))
        assert plan.memory_cap == cap  # validate() checked the holdings


def test_cache_round_trip_and_hits(tmp_path):
    cache = PlanCache(tmp_path)
    request = PlanRequest(3, 4, 4, [(2, 1)])
    first = cache.get_or_plan(request)
    assert (cache.hits, cache.misses) == (0, 1)
    again = cache.get_or_plan(request)
    relabelled = cache.get_or_plan(request.with_failed([(1, 1)]))
    assert (cache.hits, cache.misses) == (2, 1)
    for plan in (first, again, relabelled):
        _check(plan)
    assert relabelled.failed == ((1, 1),) and (1, 1) not in relabelled.workers
    assert relabelled.iteration_time == first.iteration_time
    assert again == first
    # a fresh cache reads the entry back from disk
    other = PlanCache(tmp_path)
    from_disk = other.get(request)
    assert other.hits == 1 and from_disk == first
    # different costs, cap or options are different entries
    assert cache.get(replace(request, memory_cap=2)) is None
    assert cache.get(replace(request, costs=CostModel.uniform(4, comm=1))) is None
    assert cache.get(replace(request, options=ScheduleOptions(decoupled=False))) is None


def test_the_canonical_sets_cover_every_failure_set_and_their_plans_every_relabelling(tmp_path):
    D, P = 3, 3
    for max_failures in range(4):
        brute = set()
        workers = [(p, s) for p in range(D) for s in range(P)]
        for size in range(max_failures + 1):
            for failed in itertools.combinations(workers, size):
                if all(sum(1 for _p, s in failed if s == q) < D for q in range(P)):
                    brute.add(canonical(D, P, failed)[0])
        assert set(canonical_failure_sets(D, P, max_failures)) == brute
    cache = PlanCache(tmp_path)
    request = PlanRequest(D, P, 3)
    for failed in canonical_failure_sets(D, P, 2):
        cache.get_or_plan(request.with_failed(failed))
    count = len(set(canonical_failure_sets(D, P, 2)))
    assert count == len(cache) == cache.misses
    misses = cache.misses
    rng = random.Random(1)
    for _ in range(20):
        failed = rng.sample([(p, s) for p in range(D) for s in range(P)], rng.randint(0, 2))
        if any(sum(1 for _p, s in failed if s == q) == D for q in range(P)):
            continue
        _check(cache.get_or_plan(request.with_failed(failed)))
    assert cache.misses == misses  # all hits
    assert math.isclose(len(list(tmp_path.glob("*.json"))), count)
