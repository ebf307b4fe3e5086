"""The fault-free plan: every micro-batch in its home pipeline, scheduled ZB-H1-like."""

from __future__ import annotations

from ds_recycle.planner.list_scheduler import ScheduleOptions, identity_assignment, list_schedule
from ds_recycle.planner.plan import CostModel, Plan


def fault_free_plan(
    pipelines: int,
    stages: int,
    microbatches: int,
    costs: CostModel | None = None,
    memory_cap: int | None = None,
    options: ScheduleOptions = ScheduleOptions(),
) -> Plan:
    """``memory_cap`` defaults to ``stages``: the most micro-batches stock 1F1B keeps alive on
    any worker (stage 0), so the schedule never holds more micro-batches than stock does."""
    costs = costs or CostModel.uniform(stages)
    cap = stages if memory_cap is None else memory_cap
    workers = list_schedule(
        pipelines, stages, microbatches, identity_assignment(pipelines, stages, microbatches), costs, cap, options
    )
    makespan = max((op.end for ops in workers.values() for op in ops), default=0.0)
    return Plan(
        pipelines,
        stages,
        microbatches,
        (),
        costs,
        cap,
        workers,
        iteration_time=makespan,
        solver="fault-free",
        extra={"decoupled": options.decoupled, "staggered": options.staggered},
    )
