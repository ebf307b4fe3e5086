"""PlanRequest: one planning problem, the one value that names it.

:class:`~ds_recycle.planner.cache.PlanCache` and
:class:`~ds_recycle.planner.prefetch.PlanPrefetcher` take a PlanRequest. The planner functions
(``plan_heuristic``, ``plan_milp``, ``lower_bound``) take plain parameters whose first ones are
PlanRequest's fields in the same order (``pipelines, stages, microbatches, failed, costs,
memory_cap, options``), so ``PlanRequest(*args)`` and ``plan_heuristic(*args)`` read alike; each
builds a PlanRequest, which fills in the defaults and checks them in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import CostModel, Worker


@dataclass(frozen=True)
class PlanRequest:
    """A topology, a failure set, a cost model, a memory cap and schedule options.

    Construction fills in the defaults and normalizes: ``failed`` becomes a sorted tuple of
    distinct ``(pipeline, stage)`` pairs, ``costs`` (None: unit costs) and ``memory_cap`` (None:
    ``stages``, the peak of stock 1F1B) are never None afterwards. Raises ValueError for a
    topology below 1, a cost model of another stage count, or a memory cap below 1. Whether every
    stage keeps a survivor is checked by ``lower_bound.check_survivors``."""

    pipelines: int
    stages: int
    microbatches: int
    failed: Iterable[Worker] = ()
    costs: CostModel | None = None
    memory_cap: int | None = None
    options: ScheduleOptions = ScheduleOptions()

    def __post_init__(self) -> None:
        D, P, m = self.pipelines, self.stages, self.microbatches
        if D < 1 or P < 1 or m < 1:
            raise ValueError(f"pipelines={D}, stages={P}, microbatches={m} must all be >= 1")
        costs = self.costs or CostModel.uniform(P)
        if costs.stages != P:
            raise ValueError(f"cost model has {costs.stages} stages, the topology has {P}")
        cap = P if self.memory_cap is None else self.memory_cap
        if cap < 1:
            raise ValueError(f"memory_cap={cap}: a worker must be able to hold at least 1 micro-batch")
        object.__setattr__(self, "failed", tuple(sorted({(int(p), int(s)) for p, s in self.failed})))
        object.__setattr__(self, "costs", costs)
        object.__setattr__(self, "memory_cap", cap)

    def with_failed(self, failed: Iterable[Worker]) -> PlanRequest:
        """This request for the failure set ``failed`` instead."""
        return replace(self, failed=failed)
