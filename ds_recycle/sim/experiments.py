"""The three experiments of the paper study (docs/simulator.md), on the same failures for every system.

- :func:`sweep`: ``f = 0 .. D-1`` workers fail at once (spread over stages, on one stage, or in one
  pipeline); every system runs a window of ``window_s`` from the failure, event costs included,
  and its steady rate after the failure is reported too.
- :func:`trace_replay`: a node availability trace replayed against every system.
- :func:`poisson`: a production-scale job; every worker (a TP group) fails at the Llama 3 per-GPU
  rate (times a multiple) and comes back after a repair time; optional spare workers.

Every system gets the same node names and the same events: node ``i`` of the initial list is
ReCycle's slot ``i`` (worker ``(i // P, i % P)``), Bamboo's stage ``i % P_B`` of pipeline
``i // P_B``, the checkpoint-restart job's worker ``(i // P, i % P)``; Oobleck uses the count.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.plan import Worker
from ds_recycle.sim.bamboo import Bamboo, BambooParams
from ds_recycle.sim.causes import FailureModel, cause_events
from ds_recycle.sim.checkpoint import CheckpointParams, CheckpointRestart
from ds_recycle.sim.job import LLAMA3_RATE_PER_GPU_DAY, Job
from ds_recycle.sim.job_restart import JobRestart, JobRestartParams
from ds_recycle.sim.oobleck import Oobleck, OobleckParams
from ds_recycle.sim.recycle import Recycle, RecycleParams
from ds_recycle.sim.replica_restart import ReplicaRestart, ReplicaRestartParams
from ds_recycle.sim.timeline import Event, Run, System, replay
from ds_recycle.sim.traces import Trace

SYSTEMS = ("recycle", "oobleck", "bamboo", "checkpoint")
"""The systems of the paper study (the default of every experiment)."""
ALL_SYSTEMS = ("recycle", "replica-restart", "job-restart", "oobleck", "bamboo", "checkpoint")
"""Every system :func:`make_system` builds, with the 2026 baselines of issue 44 (``sim/ettr.py``)."""
PLACEMENTS = ("spread", "stage", "pipeline")


@dataclass(frozen=True)
class SystemParams:
    recycle: RecycleParams = field(default_factory=RecycleParams)
    oobleck: OobleckParams = field(default_factory=OobleckParams)
    bamboo: BambooParams = field(default_factory=BambooParams)
    checkpoint: CheckpointParams = field(default_factory=CheckpointParams)
    replica_restart: ReplicaRestartParams = field(default_factory=ReplicaRestartParams)
    job_restart: JobRestartParams = field(default_factory=JobRestartParams)


def make_system(name: str, job: Job, params: SystemParams, clock_offset: float = 0.0, cache=None) -> System:
    if name == "recycle":
        return Recycle(job, params.recycle, cache, clock_offset)
    if name == "oobleck":
        return Oobleck(job, params.oobleck, clock_offset)
    if name == "bamboo":
        return Bamboo(job, params.bamboo, clock_offset)
    if name == "checkpoint":
        return CheckpointRestart(job, params.checkpoint, clock_offset)
    if name == "replica-restart":
        return ReplicaRestart(job, params.replica_restart, clock_offset)
    if name == "job-restart":
        return JobRestart(job, params.job_restart, clock_offset)
    raise ValueError(f"unknown system {name!r}: one of {', '.join(ALL_SYSTEMS)}")


def fault_free_rate(name: str, job: Job, params: SystemParams, initial: Sequence[str], cache=None) -> float:
    """Samples/s of system ``name`` on ``initial`` with no failure (its steady rate at the start)."""
    return make_system(name, job, params, 0.0, cache).start(list(initial))[-1].rate


def ettr(run: Run, fault_free_samples_per_s: float) -> float:
    """Effective training time ratio: the useful work of ``run`` over what the same system would
    have done with no failure in the same wall time (its fault-free rate times the duration)."""
    if fault_free_samples_per_s <= 0 or run.duration <= 0:
        return 0.0
    return run.samples / (fault_free_samples_per_s * run.duration)


def placement_workers(pipelines: int, stages: int, failures: int, placement: str) -> list[Worker]:
    """The ``failures`` failed workers ``(pipeline, stage)`` of a placement.

    - ``spread``: failure ``j`` at pipeline ``j``, stage ``j mod P`` (distinct pipelines; distinct
      stages while ``f <= P``);
    - ``stage``: pipelines ``0..f-1`` of the last stage (the heaviest: it runs the LM head);
    - ``pipeline``: workers ``0..f-1`` in pipeline-major order (pipeline 0 first)."""
    D, P, f = pipelines, stages, failures
    if not 0 <= f <= D * P:
        raise ValueError(f"{f} failures do not fit a grid of {D} x {P}")
    if placement == "spread":
        return [(j % D, (j + j // D) % P) for j in range(f)]
    if placement == "stage":
        return [(j % D, (P - 1 - j // D) % P) for j in range(f)]
    if placement == "pipeline":
        return [(j // P, j % P) for j in range(f)]
    raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")


# ----- E1: concurrent-failure sweep -----------------------------------------------------------


@dataclass
class SweepRow:
    failures: int
    failed: list[Worker]
    runs: dict[str, Run]
    steady: dict[str, float]
    """Samples/s each system runs at once the failure has been handled."""
    recycle: dict[str, float | str | None] = field(default_factory=dict)
    """ReCycle's references: lower-bound and rerouting-only rates, the period's source."""

    def to_dict(self) -> dict:
        return {
            "failures": self.failures,
            "failed": [list(w) for w in self.failed],
            "systems": {
                name: {**run.to_dict(), "steady_samples_per_s": self.steady[name]} for name, run in self.runs.items()
            },
            "recycle": self.recycle,
        }


@dataclass
class Study:
    experiment: str
    config: dict
    runs: dict[str, Run]
    """Each system over the whole experiment (sweep: the mean over rows)."""
    rows: list[SweepRow] = field(default_factory=list)
    series: list[dict] = field(default_factory=list)
    """Poisson: one entry per repetition (seed)."""
    fault_free: dict[str, float] = field(default_factory=dict)
    """Poisson: each system's samples/s with no failure, the reference of its ETTR."""

    def ettr(self, name: str) -> float | None:
        """The ETTR of system ``name`` (None where no fault-free reference was computed)."""
        if name not in self.fault_free:
            return None
        return ettr(self.runs[name], self.fault_free[name])

    def samples_per_s(self, name: str) -> float:
        return self.runs[name].samples_per_s

    def ratios(self) -> dict[str, dict]:
        """``recycle/<baseline>``: the maximum ratio and where it occurs."""
        out = {}
        if "recycle" not in self.runs:
            return out
        for other in self.runs:
            if other == "recycle":
                continue
            points = []
            if self.rows:
                for row in self.rows:
                    points.append(
                        (_ratio(row.runs["recycle"].samples_per_s, row.runs[other].samples_per_s), f"f={row.failures}")
                    )
            else:
                points.append(
                    (_ratio(self.samples_per_s("recycle"), self.samples_per_s(other)), self.config.get("label", ""))
                )
            finite = [p for p in points if p[0] is not None]
            best = max(finite, key=lambda p: p[0]) if finite else (None, "no finite ratio")
            out[f"recycle/{other}"] = {
                "max": best[0],
                "at": best[1],
                "overall": _ratio(self.samples_per_s("recycle"), self.samples_per_s(other)),
            }
        return out

    def to_dict(self, segments: bool = False) -> dict:
        out = {
            "experiment": self.experiment,
            "config": self.config,
            "systems": {name: run.to_dict(segments) for name, run in self.runs.items()},
            "ratios": self.ratios(),
        }
        for name in self.fault_free:
            out["systems"][name]["ettr"] = self.ettr(name)
            out["systems"][name]["fault_free_samples_per_s"] = self.fault_free[name]
        if self.rows:
            out["rows"] = [row.to_dict() for row in self.rows]
        if self.series:
            out["repetitions"] = self.series
        return out


def _ratio(a: float, b: float) -> float | None:
    if b > 0:
        return a / b
    return None


def sweep(
    job: Job,
    placement: str = "spread",
    systems: Sequence[str] = SYSTEMS,
    params: SystemParams = SystemParams(),
    window_s: float = 3600.0,
    failures: Sequence[int] | None = None,
) -> Study:
    D, P = job.pipelines, job.stages
    counts = list(range(D)) if failures is None else list(failures)
    nodes = [f"n{i}" for i in range(job.workers)]
    offset = job.checkpoint_interval / 2  # failures strike half an interval after a checkpoint
    cache = PlanCache()
    rows = []
    for f in counts:
        failed = placement_workers(D, P, f, placement)
        events = [Event(0.0, "remove", nodes[p * P + s]) for p, s in failed]
        runs, steady = {}, {}
        reference: dict[str, float | str | None] = {}
        for name in systems:
            system = make_system(name, job, params, offset, cache)
            run = replay(system, nodes, events, window_s)
            runs[name] = run
            steady[name] = system.rate()
            if isinstance(system, Recycle):
                reference = _recycle_references(system, failed)
        rows.append(SweepRow(f, failed, runs, steady, reference))
    total = {name: _mean_run(name, [row.runs[name] for row in rows]) for name in systems}
    config = {
        **job_config(job),
        "recycle_rebalance": params.recycle.rebalance.mode,
        "placement": placement,
        "window_s": window_s,
        "failures": counts,
        "label": f"{job.model.name} D={D} P={P} m={job.microbatches} {placement}",
    }
    return Study("sweep", config, total, rows)


def _recycle_references(system: Recycle, failed: list[Worker]) -> dict[str, float | str | None]:
    """ReCycle's plan against its references: the lower bound on the iteration time (from idle)
    and the rerouting-only ablation (1F1B with a fused backward, synchronous step)."""
    job = system.job
    G, eff = job.global_batch, job.checkpoint_efficiency
    figures = system.figures(failed)
    if figures is None:
        return {"period_s": None, "source": "checkpoint fallback"}
    period, iteration, source = figures
    out: dict[str, float | str | None] = {
        "period_s": period,
        "iteration_s": iteration,
        "source": source,
        "bound_s": system.bound_period(failed),
    }
    if source == "plan":
        reroute = system.rerouting_only_period(failed)
        out["rerouting_only_period_s"] = reroute
        out["rerouting_only_samples_per_s"] = None if reroute is None else G / reroute * eff
    return out


def _mean_run(name: str, runs: list[Run]) -> Run:
    total = Run(name, sum(r.duration for r in runs))
    total.samples = sum(r.samples for r in runs)
    total.downtime = sum(r.downtime for r in runs)
    for r in runs:
        for k, v in r.pauses.items():
            total.pauses[k] = total.pauses.get(k, 0.0) + v
        total.notes += r.notes
    return total


# ----- E2: trace replay -----------------------------------------------------------------------


def trace_replay(
    job: Job, trace: Trace, systems: Sequence[str] = SYSTEMS, params: SystemParams = SystemParams()
) -> Study:
    cache = PlanCache()
    runs = {
        name: replay(make_system(name, job, params, 0.0, cache), trace.initial, trace.events, trace.duration)
        for name in systems
    }
    config = {
        **job_config(job),
        "recycle_rebalance": params.recycle.rebalance.mode,
        "trace": trace.name,
        "duration_s": trace.duration,
        "peak_nodes": trace.peak,
        "removals": trace.removals,
        "label": f"{trace.name} {job.model.name} D={job.pipelines} P={job.stages} m={job.microbatches}",
    }
    return Study("trace", config, runs)


# ----- E3: production-scale Poisson -------------------------------------------------------------


def poisson_events(
    workers: int, spares: int, rate_per_worker_hour: float, hours: float, repair_hours: float, seed: int
) -> tuple[list[str], list[Event]]:
    """Initial nodes (workers then spares) and the failure/repair events: every live node fails at
    ``rate_per_worker_hour``; a failed node comes back as a new node after ``repair_hours``."""
    rng = random.Random(seed)
    live = [f"n{i}" for i in range(workers + spares)]
    initial = list(live)
    position = {n: i for i, n in enumerate(live)}
    repairs: list[tuple[float, int]] = []
    events: list[Event] = []
    horizon = hours * 3600.0
    now = 0.0
    serial = len(live)
    while True:
        total = rate_per_worker_hour * len(live) / 3600.0
        wait = rng.expovariate(total) if total > 0 else math.inf
        if repairs and repairs[0][0] <= now + wait:
            now, _ = heapq.heappop(repairs)
            if now >= horizon:
                break
            node = f"n{serial}"
            serial += 1
            position[node] = len(live)
            live.append(node)
            events.append(Event(now, "add", node))
            continue
        now += wait
        if now >= horizon:
            break
        victim = live[rng.randrange(len(live))]
        i = position.pop(victim)
        last = live.pop()
        if last != victim:
            live[i] = last
            position[last] = i
        events.append(Event(now, "remove", victim))
        heapq.heappush(repairs, (now + repair_hours * 3600.0, serial))
    return initial, events


def poisson(
    job: Job,
    rate_multiple: float = 1.0,
    hours: float = 24.0 * 7,
    repair_hours: float = 2.0,
    spare_fraction: float = 0.0,
    systems: Sequence[str] = SYSTEMS,
    params: SystemParams = SystemParams(),
    seeds: Sequence[int] = (0,),
    failure_model: FailureModel | None = None,
) -> Study:
    """``job.failures_per_hour`` should be the job's rate (for Young's interval). With
    ``failure_model`` failures come by cause (``sim/causes.py``: node-wide ones, drawn repair times)
    and ``repair_hours`` is not used; without it every failure takes one worker for ``repair_hours``."""
    per_worker = rate_multiple * LLAMA3_RATE_PER_GPU_DAY * job.model.tp / 24.0
    spares = int(round(spare_fraction * job.workers))
    cache = PlanCache()
    totals = {name: Run(name, 0.0) for name in systems}
    series = []
    fault_free: dict[str, float] = {}
    for seed in seeds:
        entry: dict = {"seed": seed, "systems": {}}
        if failure_model is None:
            initial, events = poisson_events(job.workers, spares, per_worker, hours, repair_hours, seed)
            entry["failures"] = sum(1 for e in events if e.kind == "remove")
        else:
            drawn = cause_events(
                job.workers, spares, job.model.tp, per_worker / job.model.tp, hours, failure_model, seed
            )
            initial, events = drawn.initial, drawn.events
            entry["failures"] = len(drawn.removed_per_failure)
            entry["workers_removed"] = sum(drawn.removed_per_failure)
            entry["by_cause"] = drawn.by_cause
        if not fault_free:
            fault_free = {name: fault_free_rate(name, job, params, initial, cache) for name in systems}
        for name in systems:
            run = replay(make_system(name, job, params, 0.0, cache), initial, events, hours * 3600.0)
            entry["systems"][name] = run.samples_per_s
            merged = _mean_run(name, [totals[name], run])
            merged.segments = totals[name].segments or run.segments  # the first repetition's, for plots
            totals[name] = merged
        series.append(entry)
    config = {
        **job_config(job),
        "recycle_rebalance": params.recycle.rebalance.mode,
        "rate_multiple": rate_multiple,
        "rate_per_gpu_day": rate_multiple * LLAMA3_RATE_PER_GPU_DAY,
        "hours": hours,
        "repair_hours": repair_hours if failure_model is None else failure_model.repair_mean_hours,
        "failure_model": "single" if failure_model is None else "causes",
        "spares": spares,
        "seeds": list(seeds),
        "label": f"{job.gpus} GPUs {job.model.name} x{rate_multiple:g} Llama 3 rate",
    }
    return Study("poisson", config, totals, series=series, fault_free=fault_free)


def job_config(job: Job) -> dict:
    return {
        "model": job.model.name,
        "tp": job.model.tp,
        "pipelines": job.pipelines,
        "stages": job.stages,
        "microbatches": job.microbatches,
        "gpus": job.gpus,
        "global_batch": job.global_batch,
        "checkpoint_interval_s": job.checkpoint_interval,
        "checkpoint_cost_s": job.checkpointing.cost_s,
        "restart_s": job.checkpointing.restart_s,
        "recycle_memory_cap": job.layout.memory_cap,
    }
