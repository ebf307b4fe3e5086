"""ReCycle at paper scale: the planner's steady-state period for each failure set.

The grid is ``pipelines x stages`` slots; node ``i`` of the initial list sits in slot ``i``, i.e.
worker ``(i // stages, i % stages)``, and nodes beyond the grid wait as spares. A lost node leaves
its slot dead and the survivors re-route its micro-batches (a new plan); a spare or a new node
re-joins into the dead slot of the stage with the most failures, copying its stage's state from a
DP peer. Each failure set is planned once through the plan cache (normalized, so relabelled sets
share a plan) under the memory cap; above ``max_plan_ops`` F/B/W ops the planner's lower bound
stands in for the plan (flagged ``bound`` in the results). A stage with no survivor, or a failure
set the planner cannot fit under the memory cap, falls back to a checkpoint restart, after which the
live nodes are packed into the grid pipeline by pipeline (and the layers split as at the start).

With a rebalancing mode (``RecycleParams.rebalance``, ``sim/rebalance.py``), every change ends with
a look at the grid: when the planner predicts that a migration of survivors between stages (and, in
``repartition`` mode, moved stage boundaries) gains more over the expected repair time
(``sim/repair.py``) than its pause costs, the grid is re-shaped at the next iteration boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.limits import LIMITS
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import lower_bound
from ds_recycle.planner.plan import Worker
from ds_recycle.planner.request import PlanRequest
from ds_recycle.sim.job import Job
from ds_recycle.sim.rebalance import RebalanceParams, Rebalancer, Reshape, Split, pays
from ds_recycle.sim.repair import DEFAULT_PRIOR_S, RepairEstimate
from ds_recycle.sim.timeline import CheckpointClock, Phase

Failed = tuple[Worker, ...]

REROUTING_ONLY = ScheduleOptions(decoupled=False, staggered=False)


@dataclass(frozen=True)
class RecycleParams:
    detect_s: float = 5.0
    """From the failure to the survivors' agreement: a p2p/collective exception is immediate, the
    epoch vote and heartbeat confirmation take seconds (docs/design.md §6) [assumption]."""
    rebuild_s: float = 10.0
    """New communication groups for the new epoch (NCCL communicator creation at scale) [assumption]."""
    lookup_s: float = 0.001
    """Plan cache hit (a dict lookup; docs/planner.md)."""
    lost_iteration_fraction: float = 0.5
    """Expected share of the in-flight iteration rolled back and run again (uniform failure time)."""
    cap_factor: float = 2.0
    """The planner may hold up to ``cap_factor * stages`` micro-batches, if memory allows [assumption]."""
    max_plan_ops: int = 30_000
    """Largest ``3 D P m`` planned by the heuristic; above it the lower bound stands in."""
    join_with_recovery: bool = False
    """A spare at hand joins in the failure's own recovery (one group rebuild for both, its state copy
    added) instead of a re-join after it (a second rebuild) [A: not built in the engine]."""
    rebalance: RebalanceParams = RebalanceParams()
    """Whether and how the grid is re-shaped when failures unbalance it (default: never)."""
    repair_prior_s: float = DEFAULT_PRIOR_S
    """The prior of the expected repair time a re-shape is weighed over (``sim/repair.py``)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "rebuild_s", "lookup_s", "lost_iteration_fraction", "cap_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"recycle: {name} = {value!r} must be a finite number >= 0")
        if not 1 <= self.max_plan_ops <= LIMITS.max_ops:
            raise ValueError(f"recycle: max_plan_ops = {self.max_plan_ops} must be in 1..{LIMITS.max_ops}")
        if not (math.isfinite(self.repair_prior_s) and self.repair_prior_s > 0):
            raise ValueError(f"recycle: repair_prior_s = {self.repair_prior_s!r} must be a finite number > 0")


class Recycle:
    name = "recycle"

    def __init__(
        self,
        job: Job,
        params: RecycleParams = RecycleParams(),
        cache: PlanCache | None = None,
        clock_offset: float = 0.0,
    ):
        self.job = job
        self.params = params
        self.cache = cache if cache is not None else PlanCache()
        self.memory_cap = max(1, min(job.layout.memory_cap, int(params.cap_factor * job.stages)))
        self.slots: list[str | None] = [None] * job.workers
        self.spares: list[str] = []
        self.down = False
        self.notes: list[str] = []
        self.clock = CheckpointClock(job.checkpoint_interval, clock_offset)
        self._periods: dict[tuple, float | None] = {}
        self.sources: set[str] = set()
        """How periods were obtained: ``plan`` (the heuristic) and/or ``bound`` (the lower bound)."""
        self.layers: Split = job.layout.layers
        """Decoder layers per stage now (re-partitioning moves them)."""
        self.repair = RepairEstimate(params.repair_prior_s)
        self.rebalancer = Rebalancer(job, params.rebalance, self.period)
        self.reshapes: list[tuple[float, Reshape, float]] = []
        """Every re-shape done: (time, the re-shape, its pause in seconds)."""

    # ----- the System protocol -----

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        self._pack(list(nodes))
        return [self._steady()]

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        before = self.rate()
        lost_worker = False
        for node in removed:
            if node in self.spares:
                self.spares.remove(node)
            elif node in self.slots:
                self.slots[self.slots.index(node)] = None
                lost_worker = True
        self.spares.extend(added)
        self.repair.arrived(len(added))
        ckpt = self.job.checkpointing
        if self.down:
            self._pack(self._alive())
            if self.down:
                return [self._steady()]
            self.notes.append("restart")
            self.clock.pause(now, ckpt.restart_s, restart=True)
            return [Phase(ckpt.restart_s, 0.0, "restart"), self._steady()]
        phases: list[Phase] = []
        if lost_worker:
            if self.period(self.failed(), self.layers) is None:
                lost = self.clock.lost(now)
                self.notes.append("checkpoint fallback")
                self._pack(self._alive())
                pause = lost + (ckpt.restart_s if not self.down else 0.0)
                self.clock.pause(now, pause, restart=True)
                phases += [Phase(lost, 0.0, "lost work")]
                if self.down:
                    self.notes.append("waiting for nodes")
                    return phases + [self._steady()]
                return phases + [Phase(ckpt.restart_s, 0.0, "restart"), self._steady()]
            p = self.params
            redo = p.lost_iteration_fraction * (self.job.global_batch / before if before > 0 else 0.0)
            phases += [Phase(redo, 0.0, "lost work"), Phase(p.detect_s + p.rebuild_s + p.lookup_s, 0.0, "recover")]
            self.notes.append("re-route")
        joined = self._fill_from_spares()
        if joined:
            copy = self.job.layout.state_bytes / self.job.hw.network_bandwidth
            merged = lost_worker and self.params.join_with_recovery
            phases.append(Phase(copy + (0.0 if merged else self.params.rebuild_s), 0.0, "re-join"))
            self.notes.append("re-join")
        phases += self._rebalance(now + sum(ph.duration for ph in phases))
        self.clock.pause(now, sum(ph.duration for ph in phases), restart=False)
        return phases + [self._steady()]

    # ----- rebalancing -----

    def _rebalance(self, boundary: float) -> list[Phase]:
        """Re-shape the grid at the first iteration boundary after ``boundary`` (the end of the
        change's pauses) when a re-shape pays for itself over the expected repair time."""
        if self.params.rebalance.mode == "off" or self.spares:
            return []
        failed = self.failed()
        now = self.period(failed, self.layers)
        if now is None:
            return []
        reshape = self.rebalancer.best(failed, self.layers)
        if reshape is None:
            return []
        pause = self.pause_s(reshape)
        horizon = self.repair.expected_s(boundary)
        if not pays(now, reshape.period_s, pause, horizon, self.params.rebalance.min_gain):
            return []
        P = self.job.stages
        for move in reshape.moves:
            source = move.source[0] * P + move.source[1]
            target = move.target[0] * P + move.target[1]
            assert self.slots[source] is not None and self.slots[target] is None
            self.slots[target], self.slots[source] = self.slots[source], None
        self.layers = reshape.layers
        self.reshapes.append((boundary, reshape, pause))
        self.notes.append(reshape.kind)
        return [Phase(pause, 0.0, "rebalance")]

    def pause_s(self, reshape: Reshape) -> float:
        """Seconds the job stops for ``reshape``: its copies, one group rebuild and a plan lookup."""
        return reshape.copy_s + self.params.rebuild_s + self.params.lookup_s

    # ----- throughput -----

    def failed(self) -> Failed:
        P = self.job.stages
        return tuple((i // P, i % P) for i, node in enumerate(self.slots) if node is None)

    def rate(self) -> float:
        """Samples per second in steady state (checkpoint cost included), 0 when down."""
        if self.down:
            return 0.0
        period = self.period(self.failed(), self.layers)
        return 0.0 if period is None else self.job.global_batch / period * self.job.checkpoint_efficiency

    def period(self, failed: Sequence[Worker], layers: Split | None = None) -> float | None:
        """Steady-state seconds per iteration for ``failed`` (and ``layers`` per stage; None: the
        job's split), or None when ReCycle cannot run it (a stage without survivor, or no plan
        under the memory cap)."""
        figures = self.figures(failed, layers)
        return None if figures is None else figures[0]

    def figures(self, failed: Sequence[Worker], layers: Split | None = None) -> tuple[float, float, str] | None:
        """(steady-state period, iteration time from idle, source) in seconds for ``failed`` and
        ``layers`` (None: the job's split); source is ``plan`` or ``bound`` (above
        ``max_plan_ops``, both figures are the bound)."""
        job = self.job
        D, P, m = job.pipelines, job.stages, job.microbatches
        per_stage = [0] * P
        for _p, s in failed:
            per_stage[s] += 1
        if any(f >= D for f in per_stage):
            return None
        failed = tuple(sorted(failed))
        split = job.layout.layers if layers is None else tuple(layers)
        layout = job.layout_for(split)
        cap = self.memory_cap if split == job.layout.layers else self._cap(layout.memory_cap)
        if cap is None:
            return None
        costs = layout.costs
        if 3 * D * P * m > self.params.max_plan_ops:
            key: tuple = ("bound", tuple(per_stage), split)
            if key not in self._periods:
                bound = lower_bound(D, P, m, failed, costs, cap) / 1e3
                self._periods[key] = (bound, bound, "bound")
            self.sources.add("bound")
            return self._periods[key]
        key = ("plan", failed, split)
        if key not in self._periods:
            try:
                plan = self.cache.get_or_plan(PlanRequest(D, P, m, failed, costs, cap))
                self._periods[key] = (plan.steady_state_period / 1e3, plan.iteration_time / 1e3, "plan")
            except ValueError:
                self._periods[key] = None
        self.sources.add("plan")
        return self._periods[key]

    def _cap(self, memory_cap: int) -> int | None:
        """The planner's memory cap for a layout that holds ``memory_cap`` micro-batches; None
        when it cannot hold what 1F1B needs (``min(P, m)``)."""
        job = self.job
        if memory_cap < min(job.stages, job.microbatches):
            return None
        return max(1, min(memory_cap, int(self.params.cap_factor * job.stages)))

    def bound_period(self, failed: Sequence[Worker]) -> float:
        """The planner's lower bound on the iteration time (from idle), in seconds."""
        job = self.job
        return lower_bound(job.pipelines, job.stages, job.microbatches, failed, job.layout.costs, self.memory_cap) / 1e3

    def rerouting_only_period(self, failed: Sequence[Worker]) -> float | None:
        """The ablation without ReCycle's schedule: the same re-routing planned with the fused
        backward of stock 1F1B and a synchronous step (no W in the bubbles, no staggered step).
        With no failure it is the stock 1F1B iteration."""
        job = self.job
        key = ("reroute", tuple(sorted(failed)))
        if key not in self._periods:
            cap = max(1, min(job.layout.fused_memory_cap, int(self.params.cap_factor * job.stages)))
            try:
                plan = plan_heuristic(
                    job.pipelines, job.stages, job.microbatches, failed, job.layout.fused, cap, REROUTING_ONLY
                )
                self._periods[key] = plan.steady_state_period / 1e3
            except ValueError:
                self._periods[key] = None
        return self._periods[key]

    # ----- helpers -----

    def _steady(self) -> Phase:
        return Phase(math.inf, self.rate())

    def _alive(self) -> list[str]:
        return [n for n in self.slots if n is not None] + self.spares

    def _pack(self, nodes: list[str]) -> None:
        n = len(self.slots)
        self.slots = [nodes[i] if i < len(nodes) else None for i in range(n)]
        self.spares = nodes[n:]
        self.layers = self.job.layout.layers
        self.down = self.period(self.failed()) is None

    def _fill_from_spares(self) -> int:
        joined = 0
        P = self.job.stages
        while self.spares:
            dead = [i for i, node in enumerate(self.slots) if node is None]
            if not dead:
                break
            per_stage = [0] * P
            for i in dead:
                per_stage[i % P] += 1
            slot = max(dead, key=lambda i: (per_stage[i % P], -i))
            self.slots[slot] = self.spares.pop(0)
            joined += 1
        return joined
