"""PlanBook: the plan this worker runs, the plans it may run next, and their predictions.

A plan depends on four inputs: the failure set, the cost model, the memory budget and the number
of micro-batches. The engine tells the book when one of them changes (:meth:`PlanBook.switch`), and
the book takes the plan for the new inputs from its memo, from the plan cache, or from the planner.
Every memo is keyed on all four, so nothing is ever cleared by hand: a change of costs or of the
memory cap simply looks up another key.

With ``recycle.prefetch_plans`` the plans of the next failures (one worker or one node beyond the
current failure set) are made in the background (:class:`~ds_recycle.planner.prefetch.PlanPrefetcher`)
so that a failure finds its plan in the cache.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ds_recycle.engine.memory_cap import MemoryBudget, peak_in_flight
from ds_recycle.errors import MemoryCapError
from ds_recycle.planner.actions import LoadMicroBatch
from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.evaluation import lower_forward_only
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import NoSurvivorError
from ds_recycle.planner.lowering import WorkerStream, lower
from ds_recycle.planner.plan import FORWARD, CostModel, Plan, Worker
from ds_recycle.planner.prefetch import PlanPrefetcher
from ds_recycle.planner.request import PlanRequest
from ds_recycle.runtime.shared.events import PlanSummary


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on besides the topology: the key of every memo of the book."""

    failed: tuple[Worker, ...]
    costs: CostModel
    budget: MemoryBudget | None
    micro_batches: int

    @property
    def cap(self) -> int | None:
        """The planner's cap of micro-batches in flight for plans that re-route (None: its default, P)."""
        return None if self.budget is None else self.budget.planner_cap()

    @property
    def plannable(self) -> bool:
        """False when not even one micro-batch fits beside a stage's static bytes."""
        return self.cap is None or self.cap >= 1


class PlanBook:
    """The plans of one worker (see the module doc)."""

    def __init__(
        self,
        pipelines: int,
        stages: int,
        worker: Worker,
        options: ScheduleOptions,
        prefetch: bool,
        nodes: tuple[tuple[Worker, ...], ...] = (),
    ) -> None:
        self.pipelines, self.stages, self.worker, self.options = pipelines, stages, worker, options
        self.nodes = nodes
        """The workers of each node when the job runs on several (the prefetcher plans their loss)."""
        self.cache = PlanCache()
        self.prefetcher = PlanPrefetcher(self.cache) if prefetch else None
        self.inputs: PlanInputs | None = None
        self.plan: Plan | None = None
        """The plan of :attr:`inputs`: the one this worker runs."""
        self.prefetched = False
        """Whether :attr:`plan` was in the plan cache before its failure set arose."""
        self._runs: dict[PlanInputs, tuple[Plan, WorkerStream]] = {}
        self._evaluations: dict[tuple[PlanInputs, bool], dict[Worker, WorkerStream]] = {}
        self._fault_free: dict[PlanInputs, float] = {}

    def switch(
        self,
        failed: Sequence[Worker] | None = None,
        costs: CostModel | None = None,
        budget: MemoryBudget | None = None,
        micro_batches: int | None = None,
    ) -> None:
        """Take the plan for the inputs given (the others stay as they are), and have the plans of
        the next failures made in the background. Raises :class:`MemoryCapError` when the plan of a
        failure set cannot fit in memory, and the planner's ValueError when it has no plan."""
        now = self.inputs
        inputs = PlanInputs(
            tuple(sorted(failed)) if failed is not None else now.failed,
            costs if costs is not None else now.costs,
            budget if budget is not None else (now.budget if now is not None else None),
            micro_batches if micro_batches is not None else now.micro_batches,
        )
        if inputs == now:
            return
        self.prefetched = bool(inputs.failed) and inputs.plannable and self.cache.get(self._request(inputs)) is not None
        self.plan = self._run(inputs)[0]
        self.inputs = inputs
        if self.prefetcher is not None and inputs.plannable:
            self.prefetcher.request(self._request(inputs), self.nodes)

    @property
    def stream(self) -> WorkerStream:
        """This worker's lowered stream of :attr:`plan`."""
        return self._run(self.inputs)[1]

    def evaluation_stream(self, micro_batches: int, any_worker_loads: bool) -> dict[Worker, WorkerStream]:
        """Every live worker's forward-only stream of ``micro_batches`` per pipeline, routed as the
        training plan routes F. When only a pipeline's own workers can load its data
        (``any_worker_loads`` false), a straggler is not routed around: it evaluates its own."""
        inputs = self.inputs
        if not any_worker_loads and inputs.costs.slow:
            inputs = replace(inputs, costs=replace(inputs.costs, slow=()))
        inputs = replace(inputs, micro_batches=micro_batches)
        key = (inputs, any_worker_loads)
        if key not in self._evaluations:
            self._evaluations[key] = lower_forward_only(self.plan_for(inputs))
        return self._evaluations[key]

    def foreign_loads(self, streams: dict[Worker, WorkerStream]) -> list[tuple[Worker, LoadMicroBatch]]:
        """The loads in ``streams`` of another pipeline's micro-batches."""
        return [
            (worker, action)
            for worker, stream in streams.items()
            for action in stream.actions
            if isinstance(action, LoadMicroBatch) and action.home != worker[0]
        ]

    def foreign_first_last_forwards(self) -> list[tuple[Worker, str]]:
        """The F of :attr:`plan` that load another pipeline's micro-batch (first or last stage)."""
        last = self.stages - 1
        return [
            (worker, op.label())
            for worker, ops in self.plan.workers.items()
            for op in ops
            if op.kind == FORWARD and op.stage in (0, last) and op.home != worker[0]
        ]

    def predicted_time(self, failed: Sequence[Worker]) -> float:
        """The planner's iteration time for the failure set ``failed`` on the inputs in use (what a
        migration's gain is judged by); infinite when its plan cannot fit in memory."""
        inputs = replace(self.inputs, failed=tuple(sorted(failed)))
        if not inputs.plannable:
            return math.inf
        return self.cache.get_or_plan(self._request(inputs)).iteration_time

    def fault_free_time(self) -> float:
        """The iteration time of the fault-free plan on the costs in use, without stragglers."""
        inputs = replace(self.inputs, failed=(), costs=self.inputs.costs.without_stragglers())
        if inputs not in self._fault_free:
            self._fault_free[inputs] = self.plan_for(inputs).iteration_time
        return self._fault_free[inputs]

    def summary(self, live_per_stage: tuple[int, ...], fault_free: float | None = None) -> PlanSummary:
        """:attr:`plan` as monitors report it."""
        plan = self.plan
        key = repr((plan.pipelines, plan.stages, plan.microbatches, plan.failed, plan.costs.to_dict()))
        rerouted = sum(
            1 for worker, ops in plan.workers.items() for op in ops if op.kind == FORWARD and op.home != worker[0]
        )
        return PlanSummary(
            plan_id=hashlib.sha1(key.encode()).hexdigest()[:10],
            failed=tuple(plan.failed),
            predicted_iteration_time=plan.iteration_time,
            fault_free_iteration_time=fault_free or self.fault_free_time(),
            lower_bound=plan.lower_bound or plan.iteration_time,
            live_per_stage=live_per_stage,
            rerouted_microbatches=rerouted,
            prefetched=self.prefetched,
        )

    def plan_for(self, inputs: PlanInputs) -> Plan:
        """The plan of ``inputs`` under the memory budget: from the plan cache when workers are
        missing or a straggler is routed around (as a failure is), else the fault-free plan.
        Raises :class:`MemoryCapError` when the plan of a failure set cannot fit."""
        budget, cap = inputs.budget, inputs.cap
        # no straggler is routed around where nothing fits
        if not inputs.failed and (not inputs.costs.slow or not inputs.plannable):
            plan = fault_free_plan(
                self.pipelines, self.stages, inputs.micro_batches, costs=inputs.costs, options=self.options
            )
            if budget is not None and budget.least >= 1 and budget.over(peak_in_flight(plan)):
                plan = fault_free_plan(
                    self.pipelines, self.stages, inputs.micro_batches, inputs.costs, budget.least, self.options
                )
            return plan
        if not inputs.plannable:
            raise _cannot_fit(inputs, "not even one micro-batch fits beside the static bytes")
        try:
            plan = self.cache.get_or_plan(self._request(inputs))
        except ValueError as error:
            if cap is None or isinstance(error, NoSurvivorError):
                raise
            raise _cannot_fit(inputs, f"the planner found no schedule under it ({error})") from error
        over = budget.over(peak_in_flight(plan)) if budget is not None else []
        if over:
            (worker, held, stage_cap), *_ = over
            raise _cannot_fit(inputs, f"its plan has worker {worker} hold {held} (stage cap {stage_cap})")
        return plan

    def _run(self, inputs: PlanInputs) -> tuple[Plan, WorkerStream]:
        if inputs not in self._runs:
            plan = self.plan_for(inputs)
            self._runs[inputs] = (plan, lower(plan)[self.worker])
        return self._runs[inputs]

    def _request(self, inputs: PlanInputs) -> PlanRequest:
        return PlanRequest(
            self.pipelines, self.stages, inputs.micro_batches, inputs.failed, inputs.costs, inputs.cap, self.options
        )


def _cannot_fit(inputs: PlanInputs, why: str) -> MemoryCapError:
    budget = inputs.budget
    stage = min(range(len(budget.stages)), key=lambda s: budget.stages[s].cap)
    return MemoryCapError(
        f"the plan for failure set {list(inputs.failed)} cannot fit in memory: memory cap {inputs.cap} micro-batches "
        f"in flight per worker, {why}; {budget.shortfall(stage, 1)}."
    )
