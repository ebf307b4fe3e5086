"""Bamboo (NSDI'23) as a small model: redundant computation in deeper pipelines.

Mechanism and parameters from Bamboo's code and simulator, Oobleck's copy of it, and Bamboo's
paper (docs/simulator.md, Sources):

- **Layout.** Pipelines are ``P_B = ceil(depth_factor * P)`` stages deep (1.5x: eager redundant
  forward needs about 1.5x the memory), ``D_B = floor(nodes / P_B)`` of them, capped at the grid's
  ``floor(D P / P_B)`` so every system has the same GPUs; left-over nodes wait in a standby queue.
  Each runs ``ceil(D m / D_B)`` micro-batches (the global batch is kept). Every node also holds
  its successor's layers (stage ``s`` mirrors ``s + 1``, the last mirrors stage 0), so the
  parameter state counts twice in memory; a model that does not fit is out of memory (rate 0).
- **Fault-free overhead.** Eager FRC: every micro-batch's forward of the successor's layers runs
  on each node too. It fills up to ``frc_bubble_fill`` of the node's 1F1B idle time; the rest
  lengthens the iteration.
- **Failover.** A lost node's predecessor adopts its stage: that worker runs both stages, so the
  pipeline is timed with the two stages merged (Bamboo's flat 1.5 slowdown is the balanced case of
  this, ``(2m + P - 1)/(m + P - 1)``), and the in-flight iteration is extended by
  ``lost_fraction`` of an iteration (lazy backward recomputation: the simulator's
  ``elapsed * 0.5``, half an iteration elapsed on average).
- **Fatal.** A lost node whose predecessor is already gone (no replica left), or a node already
  running two stages: restart from the last checkpoint.
- **Reconfiguration** after the next step when (a) some node runs two stages and at least as many
  nodes are on standby, (b) ``2 overloaded / active > 5%``, or (c) a new pipeline can be formed:
  a pause of ``reconfigure_s`` (Bamboo's simulator: 20 s for GPT-2; Oobleck's artifact: 76-450 s),
  then ``D_B`` pipelines of the live nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ds_recycle.planner.plan import CostModel
from ds_recycle.sim.job import TIMES, Job
from ds_recycle.sim.timeline import CheckpointClock, Phase


@dataclass(frozen=True)
class BambooParams:
    depth_factor: float = 1.5
    """``P_B / P`` (Bamboo's paper: about 1.5x deeper pipelines for eager FRC's memory)."""
    redundancy: float = 2.0
    """Parameter state held per node, in stages (its own and its successor's)."""
    frc_bubble_fill: float = 0.5
    """Share of a node's 1F1B idle time that eager FRC can use [assumption]."""
    lost_fraction: float = 0.25
    """Share of an iteration recomputed after a failover (Bamboo's simulator: 0.5 x elapsed)."""
    reconfigure_s: float = 20.0
    """Pause of a reconfiguration (Bamboo's simulator: 20 s for GPT-2/BERT)."""
    overload_threshold: float = 0.05
    """Rule (b): reconfigure when ``2 overloaded / active`` exceeds this."""

    def __post_init__(self) -> None:
        for name in ("depth_factor", "redundancy"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"bamboo: {name} = {value!r} must be a finite number >= 1")
        for name in ("frc_bubble_fill", "lost_fraction", "reconfigure_s", "overload_threshold"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"bamboo: {name} = {value!r} must be a finite number >= 0")


class Bamboo:
    name = "bamboo"

    def __init__(self, job: Job, params: BambooParams = BambooParams(), clock_offset: float = 0.0):
        self.job = job
        self.params = params
        self.pipes: list[list[str | None]] = []
        """Each pipeline's node per stage; None: lost, its stage adopted by the predecessor."""
        self.standby: list[str] = []
        self.notes: list[str] = []
        self.clock = CheckpointClock(job.checkpoint_interval, clock_offset)
        self._times: dict[tuple, float] = {}

    @cached_property
    def depth(self) -> int:
        return max(1, min(self.job.model.layers, math.ceil(self.params.depth_factor * self.job.stages - 1e-9)))

    @cached_property
    def max_pipelines(self) -> int:
        return self.job.workers // self.depth

    # ----- the System protocol -----

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        self._form(list(nodes))
        if self.pipes and not self.fits():
            self.notes.append("out of memory")
        return [self._steady()]

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        ckpt, p = self.job.checkpointing, self.params
        before = self.rate()
        fatal = False
        failover = False
        for node in removed:
            if node in self.standby:
                self.standby.remove(node)
                continue
            for pipe in self.pipes:
                if node in pipe:
                    s = pipe.index(node)
                    P = len(pipe)
                    predecessor_lost = P > 1 and pipe[(s - 1) % P] is None
                    doubled = P > 1 and pipe[(s + 1) % P] is None
                    pipe[s] = None
                    if P == 1 or predecessor_lost or doubled:
                        fatal = True
                    else:
                        failover = True
                    break
        self.standby.extend(added)
        if not self.pipes:
            self._form(self._alive())
            if not self.pipes:
                return [self._steady()]
            self.notes.append("restart")
            self.clock.pause(now, ckpt.restart_s, restart=True)
            return [Phase(ckpt.restart_s, 0.0, "restart"), self._steady()]
        if fatal:
            lost = self.clock.lost(now)
            self.notes.append("fatal: checkpoint restart")
            self._form(self._alive())
            restart = ckpt.restart_s if self.pipes else 0.0
            if not self.pipes:
                self.notes.append("waiting for nodes")
            self.clock.pause(now, lost + restart, restart=True)
            return [Phase(lost, 0.0, "lost work"), Phase(restart, 0.0, "restart"), self._steady()]
        phases: list[Phase] = []
        if failover:
            self.notes.append("failover")
            redo = p.lost_fraction * (self.job.global_batch / before if before > 0 else 0.0)
            phases.append(Phase(redo, 0.0, "lost work"))
        if self._should_reconfigure():
            slowed = self.rate()
            if failover and slowed > 0:  # it reconfigures after the next step
                phases.append(Phase(self.job.global_batch / slowed, slowed, "failover"))
            self.notes.append("reconfigure")
            self._form(self._alive())
            phases.append(Phase(p.reconfigure_s, 0.0, "reconfigure"))
        self.clock.pause(now, sum(ph.duration for ph in phases if ph.rate == 0), restart=False)
        return phases + [self._steady()]

    # ----- throughput -----

    def fits(self) -> bool:
        D = len(self.pipes)
        if D == 0:
            return False
        b = math.ceil(self.job.global_batch / D)
        return self.job.costs_for(self.depth, D, self.params.redundancy).fused_memory_cap >= min(self.depth, b)

    def rate(self) -> float:
        if not self.pipes or not self.fits():
            return 0.0
        job = self.job
        D = len(self.pipes)
        b = math.ceil(job.global_batch / D)
        base = job.costs_for(self.depth, D, self.params.redundancy).fused
        slowest = max(self._pipeline_time(base, tuple(n is None for n in pipe), b) for pipe in self.pipes)
        return job.global_batch / (slowest + base.step / 1e3) * job.checkpoint_efficiency

    def overloaded(self) -> int:
        return sum(1 for pipe in self.pipes for n in pipe if n is None)

    def _pipeline_time(self, base: CostModel, lost: tuple[bool, ...], b: int) -> float:
        key = (base, lost, b)
        if key not in self._times:
            costs = adopted_costs(base, lost)
            time = TIMES.pipeline(costs, b)
            overhead = 0.0
            P = costs.stages
            for s in range(P):
                busy = b * (costs.F[s] + costs.B[s]) / 1e3
                idle = max(0.0, time - busy)
                frc = b * costs.F[(s + 1) % P] / 1e3 if P > 1 else 0.0
                overhead = max(overhead, frc - self.params.frc_bubble_fill * idle)
            self._times[key] = time + overhead
        return self._times[key]

    def _should_reconfigure(self) -> bool:
        over = self.overloaded()
        active = sum(1 for pipe in self.pipes for n in pipe if n is not None)
        formable = min(self.max_pipelines, len(self._alive()) // self.depth)
        return (
            (over > 0 and len(self.standby) >= over)
            or (active > 0 and 2 * over / active > self.params.overload_threshold)
            or formable > len(self.pipes)
        )

    def _alive(self) -> list[str]:
        return [n for pipe in self.pipes for n in pipe if n is not None] + self.standby

    def _form(self, nodes: list[str]) -> None:
        D = min(self.max_pipelines, len(nodes) // self.depth)
        P = self.depth
        self.pipes = [list(nodes[i * P : (i + 1) * P]) for i in range(D)]
        self.standby = nodes[D * P :]

    def _steady(self) -> Phase:
        return Phase(math.inf, self.rate())


def adopted_costs(costs: CostModel, lost: Sequence[bool]) -> CostModel:
    """The pipeline's costs when the stages in ``lost`` are run by their predecessors (the last
    stage adopts stage 0): one entry per live worker, its own stage plus any adopted one."""
    P = costs.stages
    if not any(lost):
        return costs
    F, B, W = [], [], []
    for s in range(P):
        if lost[s]:
            continue
        nxt = (s + 1) % P
        extra = lost[nxt] and nxt != s
        F.append(costs.F[s] + (costs.F[nxt] if extra else 0.0))
        B.append(costs.B[s] + (costs.B[nxt] if extra else 0.0))
        W.append(costs.W[s] + (costs.W[nxt] if extra else 0.0))
    return CostModel(tuple(F), tuple(B), tuple(W), costs.comm, costs.step)
