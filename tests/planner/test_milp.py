"""The MILP planner: valid plans on small random failure sets, never worse than the warm start, gap reported."""

from __future__ import annotations

import random

import mip
import pytest
from streams import check_lowering

from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.list_scheduler import ScheduleOptions, list_schedule
from ds_recycle.planner.lower_bound import NoSurvivorError
from ds_recycle.planner.milp import plan_milp
from ds_recycle.planner.plan import STEP, CostModel, Plan
from ds_recycle.planner.validator import validate


def _random_failures(rng: random.Random, D: int, P: int) -> list[tuple[int, int]]:
    """1..D-1 failures per chosen stage, in one or two stages, every stage keeps a survivor."""
    stages = rng.sample(range(P), k=rng.choice([1, 2]) if P > 1 else 1)
    failed = []
    for s in stages:
        for p in rng.sample(range(D), k=rng.randint(1, D - 1)):
            failed.append((p, s))
    return failed


def _unbalanced_warm_start(D: int, P: int, m: int, failed, costs: CostModel, cap: int) -> Plan:
    """A deliberately poor but valid plan: every re-routed micro-batch goes to the first survivor."""
    dead = set(failed)
    first = {s: min(p for p in range(D) if (p, s) not in dead) for s in range(P)}
    assignment = {(h, k, s): (first[s] if (h, s) in dead else h) for h in range(D) for k in range(m) for s in range(P)}
    workers = list_schedule(D, P, m, assignment, costs, cap)
    makespan = max(op.end for ops in workers.values() for op in ops)
    plan = Plan(D, P, m, tuple(sorted(failed)), costs, cap, workers, iteration_time=makespan, solver="test")
    validate(plan)
    check_lowering(plan)
    return plan


@pytest.mark.parametrize("seed", range(6))
def test_milp_plans_are_valid_and_never_worse_than_the_heuristic(seed: int) -> None:
    rng = random.Random(seed)
    D, P, m = rng.choice([2, 3]), rng.choice([2, 3, 4]), rng.choice([2, 3, 4])
    failed = _random_failures(rng, D, P)
    costs = CostModel(
        tuple(rng.choice([1.0, 2.0]) for _ in range(P)),
        tuple(rng.choice([1.0, 2.0]) for _ in range(P)),
        tuple(rng.choice([0.5, 1.0]) for _ in range(P)),
        comm=rng.choice([0.0, 0.25]),
        step=rng.choice([0.0, 1.0]),
    )
    warm = plan_heuristic(D, P, m, failed, costs)
    plan = plan_milp(D, P, m, failed, costs, time_limit=1.5, warm_start=warm)
    validate(plan)
    check_lowering(plan)
    assert plan.solver == "milp"
    assert plan.iteration_time <= warm.iteration_time + 1e-9
    assert plan.iteration_time >= plan.lower_bound - 1e-9
    assert plan.gap is not None and 0.0 <= plan.gap <= 1.0
    assert plan.gap <= (plan.iteration_time - plan.lower_bound) / plan.iteration_time + 1e-9
    assert plan.steady_state_period > 0 and plan.solve_seconds > 0
    assert {w for w in plan.workers} == {(p, s) for p in range(D) for s in range(P)} - set(failed)


def _solvers() -> list:
    """CBC always; HiGHS when the mip[highs] extra (highspy) is installed, as the test extra does."""
    solvers = [mip.CBC]
    try:
        mip.Model(solver_name=mip.HIGHS)
        solvers.append(mip.HIGHS)
    except Exception:
        pass
    return solvers


@pytest.mark.parametrize("solver", _solvers())
def test_milp_improves_a_poor_warm_start_and_reports_its_gap(solver: str) -> None:
    D, P, m, failed = 3, 4, 4, [(0, 1)]
    costs = CostModel.uniform(P)
    warm = _unbalanced_warm_start(D, P, m, failed, costs, P)
    plan = plan_milp(D, P, m, failed, costs, time_limit=6.0, warm_start=warm, solver_name=solver)
    validate(plan)
    check_lowering(plan)
    assert plan.extra["milp"]["solver_name"] == solver
    assert plan.iteration_time < warm.iteration_time
    assert plan.extra["milp"]["improved"] is True
    assert plan.extra["milp"]["warm_start_time"] == warm.iteration_time
    expected_gap = (plan.iteration_time - plan.extra["milp"]["objective_bound"]) / plan.iteration_time
    assert plan.gap == pytest.approx(max(0.0, expected_gap), abs=1e-9)
    # the re-routed micro-batches of (0, 1) are no longer all on one survivor
    runners = plan.runners()
    assert len({runners[("F", 0, k, 1)] for k in range(m)}) == 2


def test_milp_solves_a_tiny_instance_to_optimality() -> None:
    D, P, m, failed = 2, 2, 2, [(0, 1)]
    costs = CostModel.uniform(P)
    warm = _unbalanced_warm_start(D, P, m, failed, costs, P)  # one survivor: assignment is forced
    plan = plan_milp(D, P, m, failed, costs, time_limit=5.0, warm_start=warm)
    validate(plan)
    check_lowering(plan)
    assert plan.gap == 0.0
    # stage 1 has one worker doing 4 micro-batches of F+B+W after the first forward of stage 0
    assert plan.iteration_time == pytest.approx(1 + 4 * 3)


def test_milp_respects_a_tight_memory_cap() -> None:
    D, P, m, failed = 2, 3, 4, [(1, 1)]
    plan = plan_milp(D, P, m, failed, memory_cap=2, time_limit=2.0)
    validate(plan)
    check_lowering(plan)
    assert plan.memory_cap == 2
    for ops in plan.workers.values():
        live = [op for op in ops if op.kind != STEP]
        starts = {(op.home, op.mb): op.start for op in live if op.kind == "F"}
        ends = {(op.home, op.mb): op.end for op in live if op.kind == "W"}
        for t in starts.values():
            held = sum(1 for mb, s in starts.items() if s <= t + 1e-9 and ends[mb] > t + 1e-9)
            assert held <= 2


@pytest.mark.parametrize("options", [ScheduleOptions(decoupled=False, staggered=False), ScheduleOptions(True, False)])
def test_milp_under_ablation_options(options: ScheduleOptions) -> None:
    D, P, m, failed = 3, 3, 3, [(2, 0)]
    plan = plan_milp(D, P, m, failed, time_limit=1.5, options=options)
    validate(plan)
    check_lowering(plan)
    assert plan.extra["decoupled"] is options.decoupled and plan.extra["staggered"] is options.staggered
    if not options.decoupled:
        for ops in plan.workers.values():
            b_end = {(op.home, op.mb): op.end for op in ops if op.kind == "B"}
            for op in ops:
                if op.kind == "W":
                    assert op.start == pytest.approx(b_end[(op.home, op.mb)])
    if not options.staggered:
        steps = {op.start for ops in plan.workers.values() for op in ops if op.kind == STEP}
        assert len(steps) == 1


def test_milp_rejects_a_stage_without_survivors_and_a_mismatched_warm_start() -> None:
    with pytest.raises(NoSurvivorError, match="checkpoint"):
        plan_milp(2, 2, 2, [(0, 1), (1, 1)], time_limit=1.0)
    warm = plan_heuristic(2, 2, 2, [(0, 1)])
    with pytest.raises(ValueError, match="warm start"):
        plan_milp(2, 2, 2, [(1, 1)], time_limit=1.0, warm_start=warm)
