"""The training job every system runs: model, GPUs, global batch, and what they share.

Every system gets the same nodes (a node is one pipeline worker: ``tp`` GPUs), the same global
batch (``pipelines * microbatches`` micro-batches of one 2048-token sequence) and the same
checkpointing (cost, interval, restart time), which it uses when a failure is fatal to it.
Iteration times of 1F1B pipelines (Oobleck, Bamboo, checkpoint-restart: stock DeepSpeed-style
schedules with a fused backward and one synchronous step) come from the planner's own fault-free
list scheduler and the plan simulator, so that every system is timed by the same spine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import CostModel
from ds_recycle.sim.cost_model import StageCosts, stage_costs
from ds_recycle.sim.presets import Hardware, ModelSpec

LLAMA3_RATE_PER_GPU_DAY = 419 / (54 * 16384)
"""Unplanned interruptions per GPU-day in Llama 3 405B training: 419 in 54 days on 16,384 H100s
(docs/simulator.md, Sources)."""

ONE_F_ONE_B = ScheduleOptions(decoupled=False, staggered=False)
"""Stock DeepSpeed: fused backward, every stage steps together at the end of the iteration."""


@dataclass(frozen=True)
class Checkpointing:
    cost_s: float = 60.0
    """Blocking cost of one checkpoint (Varuna model in Oobleck's artifact: 11-120 s)."""
    restart_s: float = 300.0
    """Detect, reschedule, re-initialize and load (Megatron ~300 s at 1K GPUs, TrainMover)."""
    interval_s: float | None = None
    """None: Young's optimum ``sqrt(2 C MTTF)`` for the job's failure rate."""

    def __post_init__(self) -> None:
        for name in ("cost_s", "restart_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"checkpointing: {name} = {value!r} must be a finite number >= 0")
        if self.interval_s is not None and not (math.isfinite(self.interval_s) and self.interval_s > self.cost_s):
            raise ValueError(
                f"checkpointing: interval {self.interval_s!r} s must be finite and > the cost {self.cost_s} s"
            )


@dataclass(frozen=True)
class Job:
    model: ModelSpec
    pipelines: int
    stages: int
    microbatches: int
    hw: Hardware = field(default_factory=Hardware)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    failures_per_hour: float | None = None
    """The job's failure rate for Young's interval; None: Llama 3's rate at this GPU count."""

    def __post_init__(self) -> None:
        D, P, m = self.pipelines, self.stages, self.microbatches
        if D < 1 or P < 1 or m < 1:
            raise ValueError(f"pipelines={D}, stages={P}, microbatches={m} must be >= 1")
        if self.model.layers < P:
            raise ValueError(f"{self.model.name} has {self.model.layers} layers: cannot make {P} stages")
        need = min(P, m)
        if self.layout.fused_memory_cap < need or self.layout.memory_cap < need:
            raise ValueError(
                f"{self.model.name} on {P} stages does not fit in GPU memory: a worker holds "
                f"{min(self.layout.memory_cap, self.layout.fused_memory_cap)} micro-batches, 1F1B needs {need}; "
                "use more stages"
            )

    @property
    def workers(self) -> int:
        return self.pipelines * self.stages

    @property
    def gpus(self) -> int:
        return self.workers * self.model.tp

    @property
    def global_batch(self) -> int:
        """Micro-batches (sequences) per iteration, the same for every system."""
        return self.pipelines * self.microbatches

    @cached_property
    def layout(self) -> StageCosts:
        return stage_costs(self.model, self.stages, self.pipelines, self.hw)

    def costs_for(self, stages: int, pipelines: int, redundancy: float = 1.0) -> StageCosts:
        return _stage_costs_cached(self.model, stages, pipelines, self.hw, redundancy)

    def layout_for(self, layers: tuple[int, ...]) -> StageCosts:
        """The grid's layout with ``layers`` decoder layers per stage (a re-partitioned grid)."""
        if layers == self.layout.layers:
            return self.layout
        return _stage_costs_cached(self.model, self.stages, self.pipelines, self.hw, 1.0, layers)

    @cached_property
    def failure_rate_per_hour(self) -> float:
        if self.failures_per_hour is not None:
            return self.failures_per_hour
        return self.gpus * LLAMA3_RATE_PER_GPU_DAY / 24

    @cached_property
    def checkpoint_interval(self) -> float:
        """Seconds between checkpoint starts (the checkpoint's own cost included)."""
        if self.checkpointing.interval_s is not None:
            return self.checkpointing.interval_s
        rate = self.failure_rate_per_hour
        mttf = 3600 / rate if rate > 0 else math.inf
        young = math.sqrt(2 * self.checkpointing.cost_s * mttf)
        return max(2 * self.checkpointing.cost_s, min(young, 7 * 86400.0), 1.0)

    @property
    def checkpoint_efficiency(self) -> float:
        """Fraction of running time left after blocking checkpoints."""
        return 1.0 - self.checkpointing.cost_s / self.checkpoint_interval

    def fused_memory_ok(self, stages: int, microbatches: int, redundancy: float = 1.0) -> bool:
        """Whether a 1F1B pipeline of ``stages`` stages fits (it holds ``min(stages, b)`` micro-batches)."""
        if stages > self.model.layers:
            return False
        return self.costs_for(stages, 1, redundancy).fused_memory_cap >= min(stages, microbatches)


@dataclass(frozen=True)
class PipelineTimes:
    """Seconds of 1F1B iterations, cached per (per-stage costs, micro-batches)."""

    cache: dict = field(default_factory=dict)

    def pipeline(self, costs: CostModel, microbatches: int) -> float:
        """One pipeline's forward and backward of ``microbatches`` micro-batches under 1F1B (no step)."""
        if microbatches <= 0:
            return 0.0
        key = (costs, microbatches)
        value = self.cache.get(key)
        if value is None:
            stages = costs.stages
            plan = fault_free_plan(1, stages, microbatches, replace(costs, step=0.0), stages, ONE_F_ONE_B)
            value = plan.iteration_time / 1e3
            self.cache[key] = value
        return value


TIMES = PipelineTimes()
"""Shared by every system of a process: the same (costs, b) is planned once."""


def iteration_1f1b(job: Job, stages: int, microbatches: int, pipelines: int) -> float:
    """Seconds of one synchronous 1F1B iteration of ``pipelines`` equal pipelines of ``stages``
    stages, each running ``microbatches``: the pipeline time plus the DP step over ``pipelines``."""
    layout = job.costs_for(stages, pipelines)
    return TIMES.pipeline(layout.fused, microbatches) + layout.fused.step / 1e3


def split_batch(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


_COSTS: dict = {}


def _stage_costs_cached(
    model: ModelSpec,
    stages: int,
    pipelines: int,
    hw: Hardware,
    redundancy: float,
    layers: tuple[int, ...] | None = None,
) -> StageCosts:
    key = (model, stages, pipelines, hw, redundancy, layers)
    value = _COSTS.get(key)
    if value is None:
        value = stage_costs(model, stages, pipelines, hw, redundancy, layers=layers)
        _COSTS[key] = value
    return value
