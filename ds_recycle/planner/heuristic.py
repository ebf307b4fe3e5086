"""The heuristic planner: re-route a failed worker's micro-batches, then list-schedule.

1. Normalize the failure set (:mod:`normalize`), so that relabelled failure sets get the same plan
   up to the relabelling.
2. Assignment: at a stage with failures, the micro-batches of the failed pipelines are dealt
   round-robin, in order of their index k, over the stage's survivors, so every survivor gets
   ``floor`` or ``ceil`` of ``f_s m / (D - f_s)`` extra micro-batches, spread evenly in time.
   A re-routed micro-batch goes back to its home pipeline at the next stage. Survivors keep
   their own micro-batches in 1F1B order; a foreign one slots in next to the own one of the same k.
3. Several candidate (assignment, :class:`SchedulePolicy`) pairs are list-scheduled. All of
   them let W fill the bubbles and respect the memory cap; they differ in whether B or F goes
   first (F first at stage 0, or on the overloaded survivors, whose forwards start the round
   trips that must hide behind their extra work), in the warm-up limit (1F1B's ``P - s``, or the
   memory cap for overloaded survivors) and in whether a W that frees memory for a waiting F
   jumps the queue. The best by iteration time wins (ties: the earlier candidate); reaching the
   lower bound stops the search. The number of candidates shrinks with the problem size
   (``budget_ops``) so that D=8, P=8, m=32 still plans in well under a second.
4. The winner is re-timed as soon as possible in its order (:func:`retime`) and its steady-state
   period is measured by the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from ds_recycle.planner.list_scheduler import (
    Assignment,
    ScheduleOptions,
    SchedulePolicy,
    list_schedule,
)
from ds_recycle.planner.lower_bound import bound_parts
from ds_recycle.planner.normalize import canonical, invert, relabel
from ds_recycle.planner.plan import CostModel, Op, Plan, Worker
from ds_recycle.planner.request import PlanRequest
from ds_recycle.planner.simulate import retime_and_simulate

POLICIES: dict[str, SchedulePolicy] = {
    "zb": SchedulePolicy(),
    "heavy": SchedulePolicy(heavy_warmup=True),
    "heavy+f0+unblock": SchedulePolicy(heavy_warmup=True, forward_first_stage0=True, unblock_memory=True),
    "heavy+warm1": SchedulePolicy(heavy_warmup=True, extra_warmup=1),
    "heavy+ffirst": SchedulePolicy(heavy_warmup=True, forward_first=True),
    "f0+unblock": SchedulePolicy(forward_first_stage0=True, unblock_memory=True),
    "unblock": SchedulePolicy(unblock_memory=True),
    "f0": SchedulePolicy(forward_first_stage0=True),
    "own": SchedulePolicy(own_first=True),
    "warm1": SchedulePolicy(extra_warmup=1),
    "lookahead": SchedulePolicy(w_lookahead=True),
    "ffirst": SchedulePolicy(forward_first=True),
    "f0+unblock+own": SchedulePolicy(forward_first_stage0=True, unblock_memory=True, own_first=True),
    "f0+unblock+warm1": SchedulePolicy(forward_first_stage0=True, unblock_memory=True, extra_warmup=1),
    "heavy+hf": SchedulePolicy(heavy_warmup=True, heavy_forward_first=True),
    "heavy+hf+f0+unblock": SchedulePolicy(
        heavy_warmup=True, heavy_forward_first=True, forward_first_stage0=True, unblock_memory=True
    ),
    "heavy+hf+unblock": SchedulePolicy(heavy_warmup=True, heavy_forward_first=True, unblock_memory=True),
    "ffirst+unblock+own+lookahead": SchedulePolicy(
        forward_first=True, unblock_memory=True, own_first=True, w_lookahead=True
    ),
    "heavy+hf+f0+unblock+own+warm1": SchedulePolicy(
        heavy_warmup=True,
        heavy_forward_first=True,
        forward_first_stage0=True,
        unblock_memory=True,
        own_first=True,
        extra_warmup=1,
    ),
    "heavy+f0+own": SchedulePolicy(heavy_warmup=True, forward_first_stage0=True, own_first=True),
}
"""Candidate scheduling policies by name."""

PREFERRED: tuple[tuple[str, str], ...] = (
    ("rr1", "heavy+f0+unblock"),
    ("rr0", "ffirst+unblock+own+lookahead"),
    ("rr1", "heavy+hf+unblock"),
    ("rr0", "heavy+hf+f0+unblock+own+warm1"),
    ("rr0", "heavy+f0+own"),
    ("rr0", "ffirst"),
    ("rr0", "f0+unblock+own"),
    ("rr0", "heavy+ffirst"),
    ("rr1", "f0+unblock+own"),
    ("rr0", "heavy+hf+f0+unblock"),
    ("rr0", "heavy+f0+unblock"),
    ("rr1", "ffirst"),
    ("rr0", "heavy+warm1"),
)
"""The (assignment, policy) pairs tried first: a greedy cover of the best candidates measured
over the benchmark grid (D in 2,3,4,8; P in 4,8; m in P,2P,4P; failures in one or two stages),
so that a small budget still gets most of the quality. The other pairs follow. The three policies
with ``own`` at positions 2, 4 and 5 were added for the preset costs of ``bench/planner.py``
(B > F > W, p2p latency, memory caps down to P), where they cut the worst ratio to the lower bound
from 1.065 to 1.031, and make no case of either grid worse."""

DEFAULT_BUDGET_OPS = 30_000
"""About how many ops the candidates may list-schedule together (at least 2 candidates run)."""


def plan_heuristic(
    pipelines: int,
    stages: int,
    microbatches: int,
    failed: Iterable[Worker] = (),
    costs: CostModel | None = None,
    memory_cap: int | None = None,
    options: ScheduleOptions = ScheduleOptions(),
    budget_ops: int = DEFAULT_BUDGET_OPS,
    iterations: int = 4,
) -> Plan:
    """Plan one iteration for the failure set ``failed`` (``(pipeline, stage)`` pairs).

    ``memory_cap`` (micro-batches a worker holds between F and W) defaults to ``stages``, the
    peak of stock 1F1B. Raises NoSurvivorError if a stage has no live worker ("needs checkpoint
    fallback") and ValueError for a bad topology, failure or memory cap.
    """
    began = time.perf_counter()
    request = PlanRequest(pipelines, stages, microbatches, failed, costs, memory_cap, options)
    bound = bound_parts(request).value  # raises NoSurvivorError

    D, P = request.pipelines, request.stages
    key, permutation = canonical(D, P, request.failed)
    workers, chosen = _best_schedule(replace(request, failed=key), bound, budget_ops)
    plan = Plan(D, P, request.microbatches, key, request.costs, request.memory_cap, workers, solver="heuristic")
    plan.extra.update({"decoupled": options.decoupled, "staggered": options.staggered, "candidate": chosen["name"]})
    plan, result = retime_and_simulate(plan, iterations=iterations)
    plan = relabel(plan, invert(permutation))
    plan.failed = request.failed
    plan.lower_bound = bound
    plan.steady_state_period = result.steady_state_period
    plan.solve_seconds = time.perf_counter() - began
    return plan


def reroute_assignment(
    pipelines: int, stages: int, microbatches: int, failed: Iterable[Worker], offset: int = 0
) -> dict[tuple[int, int, int], int]:
    """``(home, mb, stage) -> pipeline``: home when alive, else dealt round-robin (starting at
    survivor ``offset``) over the stage's survivors in order of (k, home)."""
    dead: dict[int, set[int]] = {s: set() for s in range(stages)}
    for p, s in failed:
        dead[s].add(p)
    assignment: dict[tuple[int, int, int], int] = {}
    for s in range(stages):
        survivors = [p for p in range(pipelines) if p not in dead[s]]
        if not survivors:
            raise ValueError(f"stage {s} has no survivor")
        turn = offset
        for k in range(microbatches):
            for h in range(pipelines):
                if h in dead[s]:
                    assignment[(h, k, s)] = survivors[turn % len(survivors)]
                    turn += 1
                else:
                    assignment[(h, k, s)] = h
    return assignment


def candidates(
    pipelines: int, stages: int, microbatches: int, failed: Iterable[Worker]
) -> list[tuple[str, Assignment, SchedulePolicy]]:
    """Every (name, assignment, policy) the heuristic may try, most promising first. ``rr1``
    (the round-robin dealing shifted by one survivor) is only distinct when every stage keeps at
    least two survivors; otherwise it falls back to ``rr0``."""
    failed = tuple(failed)
    assignments: dict[str, Assignment] = {"rr0": reroute_assignment(pipelines, stages, microbatches, failed)}
    min_survivors = min(pipelines - sum(1 for _p, q in failed if q == s) for s in range(stages))
    if failed and min_survivors > 1:
        assignments["rr1"] = reroute_assignment(pipelines, stages, microbatches, failed, offset=1)
    order = list(PREFERRED) + [(a, p) for p in POLICIES for a in ("rr0", "rr1")]
    out, seen = [], set()
    for assignment_name, policy_name in order:
        if assignment_name not in assignments:
            assignment_name = "rr0"
        name = f"{assignment_name}/{policy_name}"
        if name not in seen:
            seen.add(name)
            out.append((name, assignments[assignment_name], POLICIES[policy_name]))
    return out


def _best_schedule(request: PlanRequest, bound: float, budget_ops: int) -> tuple[dict[Worker, list[Op]], dict]:
    D, P, m, cap = request.pipelines, request.stages, request.microbatches, request.memory_cap
    limit = max(2, budget_ops // max(1, 3 * D * P * m))
    best = None
    for tried, (name, assignment, policy) in enumerate(candidates(D, P, m, request.failed)):
        if tried >= limit:
            break
        try:
            workers = list_schedule(D, P, m, assignment, request.costs, cap, request.options, policy=policy)
        except ValueError:
            continue  # this policy got stuck; others may not
        makespan = _makespan(workers)
        if best is None or makespan < best[0] - 1e-9:
            best = (makespan, workers, {"name": name})
        if makespan <= bound + 1e-9:
            break
    if best is None:
        raise ValueError(f"heuristic: no candidate schedule found (memory_cap={cap} may be too small)")
    return best[1], best[2]


def _makespan(workers: dict[Worker, list[Op]]) -> float:
    return max((ops[-1].end for ops in workers.values() if ops), default=0.0)
