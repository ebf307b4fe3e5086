"""Oobleck (SOSP'23) as a small model: pipeline templates re-instantiated on every change.

Mechanism and parameters from Oobleck's paper, its ``sosp23-artifact`` simulator and planning code,
and TrainMover's measurements (docs/simulator.md, Sources):

- **Templates.** A pipeline of ``n`` nodes splits the layers evenly over ``n`` stages; any
  ``n >= min_nodes`` is a template (``min_nodes``: the fewest stages at which a 1F1B pipeline
  fits in GPU memory, unless given). Live nodes, at most ``D P`` of them (the others wait as
  spares, like ReCycle's), are dealt over ``x = min(D, live // min_nodes)`` pipelines as evenly
  as possible, so pipelines differ by at most one node (heterogeneous pipelines).
- **Batch distribution.** Integer micro-batches ``b_i`` per pipeline with ``sum b_i = D m`` (the
  global batch is kept), chosen to minimize the slowest pipeline; the iteration is the slowest
  pipeline's 1F1B time plus the DP step over ``x`` pipelines (``instantiator.py``
  ``_distribute_batch`` and ``execution_result.h``; there only the first layer's all-reduce is
  counted, here the whole stage's, as for every other system).
- **Events.** Each removal costs the in-flight iteration (one lost iteration, the artifact's
  ``fallback_loss_time += step_delta``) plus ``remove_downtime_s`` (TrainMover measured 57 s
  for 6.7B on 32 GPUs; the artifact uses 2-10 s). Each addition that changes the configuration
  costs ``add_downtime_s`` (TrainMover: > 100 s, cold NCCL/CUDA start); a removal and an addition at
  the same instant are one reconfiguration (the larger downtime).
- **Fatal.** More than ``f`` nodes lost at one instant (``f + 1`` pipelines tolerate ``f``
  failures; ``f`` defaults to ``D - 1``), or fewer than ``min_nodes`` live nodes: restart from the
  last checkpoint (lost work + restart time), or wait for nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ds_recycle.sim.job import TIMES, Job, split_batch
from ds_recycle.sim.timeline import CheckpointClock, Phase


@dataclass(frozen=True)
class OobleckParams:
    f: int | None = None
    """Failures tolerated at one instant; None: ``D - 1`` (the initial pipelines minus one)."""
    min_nodes: int | None = None
    """Smallest template; None: the fewest stages at which 1F1B fits in memory."""
    remove_downtime_s: float = 57.0
    """Per removal (TrainMover's measurement, 6.7B GPT on 32 GPUs); the artifact uses 2-10 s."""
    add_downtime_s: float = 100.0
    """Per re-add (TrainMover: > 100 s); the artifact folds nodes in at the next removal."""

    def __post_init__(self) -> None:
        for name in ("remove_downtime_s", "add_downtime_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"oobleck: {name} = {value!r} must be a finite number >= 0")
        if self.f is not None and self.f < 0:
            raise ValueError(f"oobleck: f = {self.f} must be >= 0")
        if self.min_nodes is not None and self.min_nodes < 1:
            raise ValueError(f"oobleck: min_nodes = {self.min_nodes} must be >= 1")


class Oobleck:
    name = "oobleck"

    def __init__(self, job: Job, params: OobleckParams = OobleckParams(), clock_offset: float = 0.0):
        self.job = job
        self.params = params
        self.nodes: list[str] = []
        self.notes: list[str] = []
        self.down = False
        self.clock = CheckpointClock(job.checkpoint_interval, clock_offset)
        self._iterations: dict[int, float] = {}

    @cached_property
    def f(self) -> int:
        return self.job.pipelines - 1 if self.params.f is None else self.params.f

    @cached_property
    def min_nodes(self) -> int:
        if self.params.min_nodes is not None:
            return self.params.min_nodes
        job = self.job
        for n in range(1, job.model.layers + 1):
            if job.fused_memory_ok(n, n):
                return n
        return job.model.layers

    # ----- the System protocol -----

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        self.nodes = list(nodes)
        self.down = self.pipelines() == 0
        return [self._steady()]

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        gone = set(removed)
        used_before = self.used()
        hit = sum(1 for n in self.nodes[:used_before] if n in gone)
        iteration = self.iteration()
        self.nodes = [n for n in self.nodes if n not in gone] + list(added)
        ckpt = self.job.checkpointing
        if self.down:
            self.down = self.pipelines() == 0
            if self.down:
                return [self._steady()]
            self.notes.append("restart")
            self.clock.pause(now, ckpt.restart_s, restart=True)
            return [Phase(ckpt.restart_s, 0.0, "restart"), self._steady()]
        fatal = hit > self.f or (hit > 0 and self.pipelines() == 0)
        if fatal:
            lost = self.clock.lost(now)
            self.notes.append("fatal: checkpoint restart")
            self.down = self.pipelines() == 0
            restart = 0.0 if self.down else ckpt.restart_s
            self.clock.pause(now, lost + restart, restart=True)
            if self.down:
                self.notes.append("waiting for nodes")
            return [Phase(lost, 0.0, "lost work"), Phase(restart, 0.0, "restart"), self._steady()]
        phases: list[Phase] = []
        downtime = 0.0
        if hit:
            phases.append(Phase(iteration if math.isfinite(iteration) else 0.0, 0.0, "lost work"))
            downtime = self.params.remove_downtime_s
            self.notes.append("reconfigure (removal)")
        if self.used() > used_before - hit:
            downtime = max(downtime, self.params.add_downtime_s)
            self.notes.append("reconfigure (re-add)")
        if downtime:
            phases.append(Phase(downtime, 0.0, "reconfigure"))
        self.clock.pause(now, sum(p.duration for p in phases), restart=False)
        return phases + [self._steady()]

    # ----- throughput -----

    def used(self) -> int:
        """Nodes in pipelines (the rest are spares)."""
        x = self.pipelines()
        return 0 if x == 0 else min(len(self.nodes), self.job.workers, x * self.job.model.layers)

    def pipelines(self) -> int:
        live = min(len(self.nodes), self.job.workers)
        return min(self.job.pipelines, live // self.min_nodes)

    def sizes(self) -> list[int]:
        x = self.pipelines()
        return split_batch(self.used(), x) if x else []

    def rate(self) -> float:
        if self.down:
            return 0.0
        it = self.iteration()
        return self.job.global_batch / it * self.job.checkpoint_efficiency if math.isfinite(it) else 0.0

    def iteration(self) -> float:
        """Seconds per iteration of the current instantiation (inf when none can run)."""
        used = self.used()
        if used == 0:
            return math.inf
        if used not in self._iterations:
            self._iterations[used] = self._iteration(self.sizes())
        return self._iterations[used]

    def _iteration(self, sizes: list[int]) -> float:
        job = self.job
        x = len(sizes)
        classes: dict[int, int] = {}
        for n in sizes:
            classes[n] = classes.get(n, 0) + 1
        costs = {n: job.costs_for(n, x).fused for n in classes}
        time = distribute(job.global_batch, classes, lambda n, b: TIMES.pipeline(costs[n], b))
        step = max(c.step for c in costs.values()) / 1e3
        return time + step

    def _steady(self) -> Phase:
        return Phase(math.inf, self.rate())


def distribute(total: int, classes: dict[int, int], time) -> float:
    """The smallest achievable max over pipelines of ``time(size, b)`` when ``total`` micro-batches
    are dealt over ``classes`` (size -> number of pipelines), every pipeline of a class getting at
    most ``b`` (``time`` is non-decreasing in ``b``).

    The optimum equals ``time(n, b)`` of some class ``n`` (the slowest pipeline); for each class,
    a binary search finds the smallest ``b`` whose time lets all classes together cover ``total``."""

    def most(n: int, limit: float) -> int:
        lo, hi = 0, math.ceil(total / classes[n])
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if time(n, mid) <= limit + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo

    best = math.inf
    for n in classes:
        lo, hi = 1, math.ceil(total / classes[n])
        while lo < hi:
            mid = (lo + hi) // 2
            limit = time(n, mid)
            if sum(c * most(k, limit) for k, c in classes.items()) >= total:
                hi = mid
            else:
                lo = mid + 1
        limit = time(n, lo)
        if sum(c * most(k, limit) for k, c in classes.items()) >= total:
            best = min(best, limit)
    return best
