"""Job restart from peers (FlashRecovery, SageMaker HyperPod checkpointless) as a small model.

Mechanism (FlashRecovery, arXiv 2509.03047; SageMaker HyperPod checkpointless training):

- the job runs ``D'`` pipelines of ``P`` stages (ReCycle's grid layout, ``ceil(D m / D')``
  micro-batches each so that the global batch is kept); nodes beyond them wait as spares;
- a failure of a working node stops the whole job: every rank restarts and restores its state from
  the in-memory state of its data-parallel peers, so at most one step is lost (the in-flight one:
  half an iteration on average, uniform failure time [A]) and the job pauses ``restart_s``:
  FlashRecovery restarts in 150 s at 4,800 devices (HyperPod checkpointless: under 2 minutes at
  thousands of accelerators); taken as independent of scale [A];
- the failed node is replaced by a spare when there is one; otherwise the job restarts on the
  ``floor(live / P)`` pipelines it can form and, when arriving nodes form another pipeline, restarts
  again on more (``restart_s``, nothing lost);
- a stage with no live replica left cannot be restored from peers: the job restarts from the last
  checkpoint (the lost work since it and the job's checkpoint restart time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ds_recycle.sim.job import Job
from ds_recycle.sim.packed import PackedPipelines
from ds_recycle.sim.timeline import Phase

FLASHRECOVERY_RESTART_S = 150.0
"""FlashRecovery (arXiv 2509.03047): recovery in 150 s for a job on 4,800 devices."""


@dataclass(frozen=True)
class JobRestartParams:
    restart_s: float = FLASHRECOVERY_RESTART_S
    """Whole-job restart from peers' in-memory state (FlashRecovery: 150 s at 4,800 devices)."""
    lost_iteration_fraction: float = 0.5
    """Expected share of the in-flight step lost (at most one step; uniform failure time) [A]."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise ValueError(f"job-restart: restart_s = {self.restart_s!r} must be a finite number >= 0")
        if not 0 <= self.lost_iteration_fraction <= 1:
            raise ValueError(
                f"job-restart: lost_iteration_fraction = {self.lost_iteration_fraction!r} must be in [0, 1] "
                "(at most one step is lost)"
            )


class JobRestart(PackedPipelines):
    name = "job-restart"

    def __init__(self, job: Job, params: JobRestartParams = JobRestartParams(), clock_offset: float = 0.0):
        super().__init__(job, params, clock_offset)

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        gone = set(removed)
        P = self.job.stages
        hit_pipelines = {i // P for i, n in enumerate(self.active) if n in gone}
        iteration = self.iteration()
        before = self.pipelines
        alive = [n for n in self.active + self.spares if n not in gone] + list(added)
        restart = self.params.restart_s
        if hit_pipelines:
            stage_lost = any(all(self.active[p * P + s] in gone for p in range(before)) for s in range(P))
            self._pack(alive)
            if stage_lost:
                lost = self.clock.lost(now)
                restart = self.job.checkpointing.restart_s if self.pipelines else 0.0
                self.notes.append("fatal: checkpoint restart")
            else:
                lost = self.params.lost_iteration_fraction * iteration
                self.notes.append("job restart")
            if self.pipelines == 0:
                self.notes.append("waiting for nodes")
                restart = 0.0
            self.clock.pause(now, lost + restart, restart=stage_lost)
            return [Phase(lost, 0.0, "lost work"), Phase(restart, 0.0, "restart"), self._steady()]
        if self._target(len(alive)) > before:
            self._pack(alive)
            self.notes.append("grow" if before else "restart")
            self.clock.pause(now, restart, restart=False)
            return [Phase(restart, 0.0, "restart"), self._steady()]
        self._keep_spares(alive)
        return [self._steady()]
