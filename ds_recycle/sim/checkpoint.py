"""Checkpoint-restart: stock 1F1B pipelines that restart from the last checkpoint on any failure.

Model (the Varuna model of Oobleck's artifact, Young's interval; docs/simulator.md, Sources):

- the job runs ``D'`` pipelines of ``P`` stages (the same layout as ReCycle's grid), each running
  ``ceil(D m / D')`` micro-batches so that the global batch is kept;
- a checkpoint costs ``C`` seconds every ``tau`` seconds of running (fixed, or Young's
  ``sqrt(2 C MTTF)``), charged as the rate factor ``1 - C / tau``;
- a failure of a working node pauses ``R`` (restart: detect, reschedule, re-initialize, load), then
  redoes the running time since the last checkpoint (at most one interval). A failure during that
  restart or redo cancels it: the job restarts again and redoes the same work, since it has not
  reached a new checkpoint (``CheckpointClock.roll_back``). Under failures more frequent than
  ``R`` plus the redo, the job makes no progress;
- policy ``shrink`` restarts on ``D' = floor(live / P)`` pipelines at once ("job morphing");
  ``wait`` restarts only when ``D P`` nodes are live again (a replacement or a repair);
- with ``shrink``, when spare nodes can form another pipeline the job checkpoints and restarts on
  more pipelines (a planned restart: ``C + R``, nothing lost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ds_recycle.sim.job import Job
from ds_recycle.sim.packed import PackedPipelines
from ds_recycle.sim.replica_restart import consume
from ds_recycle.sim.timeline import Phase

POLICIES = ("shrink", "wait")


@dataclass(frozen=True)
class CheckpointParams:
    policy: str = "shrink"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"checkpoint policy {self.policy!r}: one of {', '.join(POLICIES)}")


class CheckpointRestart(PackedPipelines):
    name = "checkpoint"
    cancels_pending = True
    """A failure cancels a restart or a redo under way (``sim/timeline.py``)."""

    def __init__(self, job: Job, params: CheckpointParams = CheckpointParams(), clock_offset: float = 0.0):
        super().__init__(job, params, clock_offset)
        self._pending: list[Phase] = []
        self._pending_since = 0.0

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        self._pending, self._pending_since = super().start(nodes), 0.0
        return self._pending

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        kept = consume(self._pending, now - self._pending_since)[:-1]
        phases = self._change(now, removed, added, kept)
        self._pending, self._pending_since = phases, now
        return phases

    def _change(self, now: float, removed: Sequence[str], added: Sequence[str], kept: list[Phase]) -> list[Phase]:
        gone = set(removed)
        hit = any(n in gone for n in self.active)
        alive = [n for n in self.active + self.spares if n not in gone] + list(added)
        ckpt = self.job.checkpointing
        if hit:
            self._pack(alive)
            self.notes.append("restart")
            if self.pipelines == 0:
                self.notes.append("waiting for nodes")
                self.clock.roll_back(now, math.inf)
                return [self._steady()]
            lost = self.clock.roll_back(now, ckpt.restart_s)
            return [Phase(ckpt.restart_s, 0.0, "restart"), Phase(lost, 0.0, "lost work"), self._steady()]
        before = self.pipelines
        target = self._target(len(alive))
        if target > before:
            self._pack(alive)
            if before == 0:
                self.notes.append("restart")
                lost = self.clock.roll_back(now, ckpt.restart_s)
                return [Phase(ckpt.restart_s, 0.0, "restart"), Phase(lost, 0.0, "lost work"), self._steady()]
            self.notes.append("grow")
            pause = ckpt.cost_s + ckpt.restart_s
            self.clock.pause(now, pause, restart=True)
            return kept + [Phase(pause, 0.0, "grow"), self._steady()]
        self._keep_spares(alive)
        return kept + [self._steady()]

    def _target(self, live: int) -> int:
        job = self.job
        if self.params.policy == "wait":
            return job.pipelines if live >= job.workers else 0
        return super()._target(live)
