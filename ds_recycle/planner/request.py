"""PlanRequest: one planning problem, the parameter group the planner's entry points share.

``plan_heuristic``, ``lower_bound`` and :class:`~ds_recycle.planner.cache.PlanCache` keep their
plain signatures (``(pipelines, stages, microbatches, failed, costs, memory_cap, options)``); each
turns its arguments into a PlanRequest, which fills in the defaults and checks them in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import CostModel, Worker


@dataclass(frozen=True, init=False)
class PlanRequest:
    """A topology, a failure set, a cost model, a memory cap and schedule options.

    ``failed`` becomes a sorted tuple of distinct ``(pipeline, stage)`` pairs, ``costs`` defaults
    to unit costs and ``memory_cap`` to ``stages`` (the peak of stock 1F1B). Raises ValueError for
    a topology below 1, a cost model of another stage count, or a memory cap below 1. Whether every
    stage keeps a survivor is checked by ``lower_bound.check_survivors``."""

    pipelines: int
    stages: int
    microbatches: int
    failed: tuple[Worker, ...]
    costs: CostModel
    memory_cap: int
    options: ScheduleOptions

    def __init__(
        self,
        pipelines: int,
        stages: int,
        microbatches: int,
        failed: Iterable[Worker] = (),
        costs: CostModel | None = None,
        memory_cap: int | None = None,
        options: ScheduleOptions = ScheduleOptions(),
    ) -> None:
        if pipelines < 1 or stages < 1 or microbatches < 1:
            raise ValueError(f"pipelines={pipelines}, stages={stages}, microbatches={microbatches} must all be >= 1")
        costs = costs or CostModel.uniform(stages)
        if costs.stages != stages:
            raise ValueError(f"cost model has {costs.stages} stages, the topology has {stages}")
        cap = stages if memory_cap is None else memory_cap
        if cap < 1:
            raise ValueError(f"memory_cap={cap}: a worker must be able to hold at least 1 micro-batch")
        values = {
            "pipelines": pipelines,
            "stages": stages,
            "microbatches": microbatches,
            "failed": tuple(sorted({(int(p), int(s)) for p, s in failed})),
            "costs": costs,
            "memory_cap": cap,
            "options": options,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
