"""Whole pipelines packed from live nodes: the layout that checkpoint-restart and job-restart share.

The job runs ``D'`` pipelines of ``P`` stages (ReCycle's grid layout), each running
``ceil(D m / D')`` micro-batches so that the global batch is kept; nodes beyond them wait as spares.
A system built on it decides only how many pipelines it runs (:meth:`PackedPipelines._target`) and
what a change of nodes costs (its ``change``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ds_recycle.sim.job import Job, iteration_1f1b
from ds_recycle.sim.timeline import CheckpointClock, Phase


class PackedPipelines:
    """The running pipelines' nodes, the spares, and the rate they train at."""

    def __init__(self, job: Job, params: object, clock_offset: float = 0.0):
        self.job = job
        self.params = params
        self.active: list[str] = []
        """Nodes of the running pipelines, ``P`` per pipeline."""
        self.spares: list[str] = []
        self.notes: list[str] = []
        self.clock = CheckpointClock(job.checkpoint_interval, clock_offset)

    @property
    def pipelines(self) -> int:
        return len(self.active) // self.job.stages

    def iteration(self) -> float:
        """Seconds per iteration on the running pipelines (inf when none runs)."""
        D = self.pipelines
        if D == 0:
            return math.inf
        job = self.job
        return iteration_1f1b(job, job.stages, math.ceil(job.global_batch / D), D)

    def rate(self) -> float:
        it = self.iteration()
        return self.job.global_batch / it * self.job.checkpoint_efficiency if math.isfinite(it) else 0.0

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        self._pack(list(nodes))
        return [self._steady()]

    def _target(self, live: int) -> int:
        """Pipelines to run on ``live`` nodes: as many as they form, at most the job's."""
        return min(self.job.pipelines, live // self.job.stages)

    def _pack(self, nodes: list[str]) -> None:
        used = self._target(len(nodes)) * self.job.stages
        self.active, self.spares = nodes[:used], nodes[used:]

    def _keep_spares(self, alive: list[str]) -> None:
        """The running pipelines stay as they are; every other live node is a spare."""
        active = set(self.active)
        self.spares = [n for n in alive if n not in active]

    def _steady(self) -> Phase:
        return Phase(math.inf, self.rate())
