"""CostProfiler: the planner's cost model of this job, measured (``recycle.profile``) or emulated.

Before a profile is agreed, the costs are ``recycle.emulate_timing``'s durations, else unit costs.
Every worker records its op durations after each iteration (:class:`~ds_recycle.engine.profile.OpTimes`);
at the boundaries where an agreement is due, its row goes into the engine's one boundary exchange
(:meth:`RecyclePipelineEngine._agree_at_boundary`) and every rank takes the same decision from the
agreed table (:mod:`ds_recycle.engine.profile`).
"""

from __future__ import annotations

from ds_recycle.config import RecycleConfig, TimingEmulation
from ds_recycle.engine.profile import (
    CostChange,
    CostDecision,
    CostTracker,
    OpTimes,
    agreement_row,
    take_agreement,
)
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.planner.plan import CostModel, Plan, Worker


class CostProfiler:
    """The cost model in use, the op times it is measured from, and the re-plans it caused."""

    def __init__(self, config: RecycleConfig, pipelines: int, stages: int) -> None:
        timing = config.emulate_timing
        if timing is not None:
            timing.check_topology(pipelines, stages)
        base = base_cost_model(timing, stages)
        self.config = config.profile
        self.pipelines, self.stages = pipelines, stages
        self.tracker = CostTracker(base, config.profile, config.stragglers, measured=base != CostModel.uniform(stages))
        self.times = OpTimes(config.profile.window)
        self.changes: list[CostChange] = []
        """Every re-plan from measured costs, in order."""
        self._epoch: int | None = None

    @property
    def in_use(self) -> CostModel:
        """The planner's costs: measured once the replicas agreed on a profile, else the base model."""
        return self.tracker.in_use

    def record(self, events: list[InstructionEvent], finished_iterations: int) -> None:
        """The op times of an iteration that finished (after the warm-up)."""
        if finished_iterations > self.config.warmup:
            self.times.record(events)

    def due(self, iteration: int, epoch: int) -> bool:
        """Whether the workers agree on costs at the start of ``iteration``: every ``interval``
        after the warm-up, and at the first of every epoch. Every rank answers the same."""
        config = self.config
        periodic = (iteration - config.warmup - 1) % config.interval == 0
        return config.enabled and iteration > config.warmup and (periodic or epoch != self._epoch)

    def row(self) -> list[float]:
        """This worker's part of the agreement."""
        return agreement_row(self.tracker, self.times.row(), self.pipelines)

    def take(self, table: list[list[float]], epoch: int, movable_stages: range) -> CostDecision:
        """The decision of the agreed ``table``; ``movable_stages``: those whose stragglers can be
        routed around (without ``training_data`` only a pipeline's own first and last stage can load
        its micro-batches)."""
        self._epoch = epoch
        profile = take_agreement(self.tracker, table, self.pipelines, self.stages)
        self.tracker.straggler_stages = set(movable_stages)
        return self.tracker.update(profile)

    def describe(self, change: CostChange, plan: Plan, failed: tuple[Worker, ...], micro_batches: int) -> list[str]:
        """One log line per straggler change of ``change`` (or one for new costs)."""
        predicted, ff, nothing = change.predicted, change.fault_free, change.doing_nothing
        versus = (
            f"predicted {predicted:.1f} ({predicted / ff:.3f}x fault-free {ff:.1f}; "
            f"doing nothing {nothing:.1f} = {nothing / ff:.3f}x)"
        )
        missing = f" with workers {list(failed)} failed" if failed else ""
        lines = []
        for straggler in change.changes:
            what = "planned as a straggler" if straggler.detected else "released (no longer a straggler)"
            give = plan.extra.get("give", {}).get(f"{straggler.worker[0]},{straggler.worker[1]}", 0)
            lines.append(
                f"ReCycle: worker {straggler.worker} {what} at iteration {change.iteration}: its ops take "
                f"{straggler.slowdown:.2f}x its stage peers'; it runs {micro_batches - give} of "
                f"{micro_batches} micro-batches{missing}; new plan {versus}"
            )
        if not change.changes:
            costs = change.costs
            lines.append(
                f"ReCycle: new plan from measured costs at iteration {change.iteration} ({'; '.join(change.reasons)}): "
                f"F {list(costs.F)} B {list(costs.B)} W {list(costs.W)} step {costs.step} ms{missing}; {versus}"
            )
        return lines


def base_cost_model(timing: TimingEmulation | None, stages: int) -> CostModel:
    """``recycle.emulate_timing``'s durations as the planner's costs, or unit costs."""
    if timing is None or timing.planner_costs == "unit":
        return CostModel.uniform(stages)
    if not any(timing.milliseconds(k, s) > 0 for k in "FBW" for s in range(stages)):
        return CostModel.uniform(stages)
    return CostModel(*(tuple(timing.milliseconds(k, s) for s in range(stages)) for k in "FBW"))
