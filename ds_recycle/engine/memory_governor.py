"""MemoryGovernor: this worker's part of the memory caps (:mod:`ds_recycle.engine.memory_cap`).

It owns the meter of what a micro-batch holds, this worker's row of the budget table, and the
budget the live workers agreed on. At the first boundary of every epoch (after the job's first
iteration, which measures) its row goes into the engine's one boundary exchange
(:meth:`RecyclePipelineEngine._agree_at_boundary`); until every stage has a measured replica, at
every boundary. Without ``recycle.memory_limit_gb`` on a CPU there is no cap and it stays idle.
"""

from __future__ import annotations

import os

import torch

from ds_recycle.engine.memory_cap import (
    AUDIT_ENV,
    BudgetRow,
    HeldMeter,
    MemoryBudget,
    budget_from_table,
    device_budget,
    executed_peak,
    limit_bytes,
    peak_in_flight,
    static_bytes,
)
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.planner.plan import Plan, Worker


class MemoryGovernor:
    """The memory budget of the job as this worker knows it (see the module doc)."""

    def __init__(self, limit_gb: float | None, module: torch.nn.Module, device: torch.device) -> None:
        self.limit = limit_bytes(limit_gb)
        self.device = device
        self.enabled = self.limit is not None or device.type == "cuda"
        audit = os.environ.get(AUDIT_ENV) == "1"
        self.meter = HeldMeter(list(module.parameters()), audit=audit) if self.enabled or audit else None
        """What each micro-batch holds between F and W (None: neither a cap nor an audit)."""
        self.budget: MemoryBudget | None = None
        """The agreed bytes and caps of every stage (None: no cap, or not measured yet)."""
        self._epoch: int | None = None
        self._row: BudgetRow | None = None

    @property
    def planner_cap(self) -> int | None:
        return None if self.budget is None else self.budget.planner_cap()

    def due(self, iteration: int, epoch: int) -> bool:
        """Whether the workers agree on the budget at this boundary: it depends only on the epoch,
        the iteration and whether this epoch has agreed, which every member shares."""
        return self.enabled and iteration >= 1 and self._epoch != epoch

    def row(self, module: torch.nn.Module, optimizer: object) -> list[float]:
        """This worker's part of the agreement: present, measured, per micro-batch, static, limit."""
        if self._row is not None:  # measured once: a worker's row does not change
            return self._row.values()
        limit = float(self.limit if self.limit is not None else device_budget(self.device))
        static = float(static_bytes(module, optimizer, self.device))
        if self.meter.per_microbatch is None:
            return BudgetRow(static=static, limit=limit).values()
        self._row = BudgetRow(1.0, 1.0, float(self.meter.per_microbatch), static, limit)
        return self._row.values()

    def take(self, table: list[list[float]], pipelines: int, stages: int, epoch: int) -> bool:
        """The agreed ``table``; whether it made the job's first budget."""
        budget = budget_from_table(table, pipelines, stages)
        if budget is None:
            return False
        self._epoch = epoch
        first = self.budget is None
        self.budget = budget
        return first

    def describe_budget(self, fault_free: Plan) -> tuple[str, str | None]:
        """The budget's log line, and a warning when the fault-free plan does not fit in it."""
        budget, stages = self.budget, len(self.budget.stages)
        cap = budget.planner_cap()
        if cap is None:
            planner = f"memory does not bind: the planner keeps its cap of {stages} (the peak of 1F1B)"
        elif cap < 1:
            planner = "no plan fits (a stage cannot hold one micro-batch)"
        else:
            planner = f"the planner's cap is {cap} micro-batches in flight per worker"
        line = f"ReCycle: memory per worker, in bytes: {budget.describe()}; {planner}"
        over = budget.over(peak_in_flight(fault_free))
        if not over:
            return line, None
        (worker, held, _), *_ = over
        if budget.least >= 1:
            what = (
                f"worker {worker} holds {held} micro-batches in flight and {budget.shortfall(worker[1], held)}; "
                f"every plan runs under a cap of {budget.least} micro-batches (slower than the fault-free schedule)"
            )
        else:
            stage = min(range(stages), key=lambda s: budget.stages[s].cap)
            what = (
                f"not even one micro-batch fits: {budget.shortfall(stage, 1)}; the fault-free plan stays as it is "
                "(over the limit), and a failure takes the fallback of a lost stage"
            )
        return line, f"ReCycle: the fault-free schedule does not fit in memory: {what}"

    def audit_line(
        self, worker: Worker, iteration: int, epoch: int, events: list[InstructionEvent], plan_cap: int
    ) -> str:
        """``DS_RECYCLE_MEMORY_AUDIT=1``: the most micro-batches this worker held in flight in an
        iteration, from the executed instructions, and the most bytes they held."""
        budget, held = self.budget, self.meter.take_peak()
        stage = budget.stages[worker[1]] if budget is not None else None
        return (
            f"ReCycle memory audit: worker {worker} iteration {iteration} epoch {epoch}: in flight at most "
            f"{executed_peak(events)} (plan cap {plan_cap}, planner cap {self.planner_cap}, stage cap "
            f"{stage.cap if stage else None}); held at most {held} bytes + static {stage.static if stage else None} "
            f"of limit {stage.limit if stage else None}"
        )
