"""What the engine reports to monitors (W&B, logs): membership changes and iterations.

The engine calls every registered :class:`Monitor` on the lowest live rank only, so a monitor has
one writer at any time; when that rank dies the next lowest takes over from the next event on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PlanSummary:
    plan_id: str
    """A short hash of the plan cache key (topology, failure set, costs, memory cap)."""
    failed: tuple[tuple[int, int], ...]
    predicted_iteration_time: float
    """In the cost model's units (milliseconds under timing emulation)."""
    fault_free_iteration_time: float
    lower_bound: float
    live_per_stage: tuple[int, ...]
    rerouted_microbatches: int
    """Micro-batch stage-ops (F per (h, k, s)) run outside their home pipeline."""
    prefetched: bool = False
    """The plan was in the plan cache before the failure set it is for arose (made ahead, in the
    background, by ``recycle.prefetch_plans``, or met before): no planner run on the switch."""

    @property
    def ratio_to_fault_free(self) -> float:
        return self.predicted_iteration_time / self.fault_free_iteration_time

    @property
    def ratio_to_lower_bound(self) -> float:
        return self.predicted_iteration_time / self.lower_bound if self.lower_bound else float("nan")


@dataclass(frozen=True)
class MembershipChange:
    epoch: int
    iteration: int
    """The first iteration run in the new epoch."""
    left: tuple[tuple[int, int], ...] = ()
    failed: tuple[tuple[int, int], ...] = ()
    joined: tuple[tuple[int, int], ...] = ()
    detection_seconds: float | None = None
    """From the failure (or the leave/join request) to the members' decision."""
    switch_seconds: float = 0.0
    """Groups rebuilt, state copied to joiners, plan looked up."""
    recovery_seconds: float | None = None
    """From the failure to running on the new plan."""
    rolled_back: bool = False
    """The in-flight iteration did not commit and runs again on the new plan."""
    plan: PlanSummary | None = None
    time: float = 0.0


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    epoch: int
    loss: float
    seconds: float
    samples: int
    plan_id: str
    extra: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


class Monitor(Protocol):
    def on_membership_change(self, event: MembershipChange) -> None: ...

    def on_iteration(self, stats: IterationStats) -> None: ...

    def close(self) -> None: ...
