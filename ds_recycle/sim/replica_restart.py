"""Replica restart (torchft, FT-HSDP) as a small model: a failure takes its data-parallel replica out.

Mechanism (torchft's quorum-based fault-tolerant HSDP; FT-HSDP, arXiv 2602.00277):

- the job runs ``D`` replicas, each one pipeline of ``P`` stages (node ``i`` of the initial list is
  worker ``(i // P, i % P)``, as for ReCycle); nodes beyond ``D P`` wait as spares;
- a failed node takes its whole replica out. The in-flight step is discarded by every replica
  (the quorum votes not to commit it: half an iteration on average, uniform failure time [A]),
  after a detection of ``detect_s`` (the same 5 s as ReCycle's [A]); the others then go on at
  ``k / D`` of the fault-free throughput with ``k`` replicas running (each keeps its local batch,
  so the global batch shrinks; the step over fewer peers is taken as unchanged [A]);
- the replica restarts on a spare node, or on the next node that arrives, and runs again
  ``restart_s`` later, fetching its state from a live peer while the others train. FT-HSDP
  reports the stall per failure cut from 10 to 3 minutes at O(100K) GPUs: ``restart_s`` = 180 s;
- with no replica left, the job restarts from the last checkpoint (lost work and the job's
  restart time), like every other system's fatal case.

The replay (``sim/timeline.py``) keeps a system's pending non-steady phases when a change comes and
appends the new ones after them. This system mirrors that pending list, so the replica returns
stay at their own ready times; but a failure that comes while another replica restarts takes
effect (its pause, its replica's share) only when that restart's pending phase ends, at most
``restart_s`` later. Until then the rate counts the newly failed replica: at most
``restart_s x rate / D`` samples too many per overlapping pair of failures (0.05% of a 180 s
restart at D = 2048; more on small grids with frequent failures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ds_recycle.sim.job import Job, iteration_1f1b
from ds_recycle.sim.timeline import CheckpointClock, Phase

FT_HSDP_RESTART_S = 180.0
"""FT-HSDP (arXiv 2602.00277): the stall per failure cut from 10 to 3 minutes at O(100K) GPUs."""


@dataclass(frozen=True)
class ReplicaRestartParams:
    restart_s: float = FT_HSDP_RESTART_S
    """From the failure until the replica runs again on a replacement node (FT-HSDP: 3 minutes)."""
    detect_s: float = 5.0
    """Until the survivors vote the in-flight step out (ReCycle's detection, [A])."""
    lost_iteration_fraction: float = 0.5
    """Expected share of the in-flight step discarded (uniform failure time) [A]."""

    def __post_init__(self) -> None:
        for name in ("restart_s", "detect_s", "lost_iteration_fraction"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"replica-restart: {name} = {value!r} must be a finite number >= 0")


def consume(phases: list[Phase], elapsed: float) -> list[Phase]:
    """What is left of ``phases`` after ``elapsed`` seconds, as the replay keeps it (ends in the
    steady phase)."""
    left = list(phases)
    while left and elapsed > 0 and not math.isinf(left[0].duration):
        head = left[0]
        if elapsed < head.duration:
            left[0] = Phase(head.duration - elapsed, head.rate, head.what)
            break
        elapsed -= head.duration
        left.pop(0)
    return left


class ReplicaRestart:
    name = "replica-restart"

    def __init__(self, job: Job, params: ReplicaRestartParams = ReplicaRestartParams(), clock_offset: float = 0.0):
        self.job = job
        self.params = params
        self.replicas: list[list[str | None]] = []
        """``P`` node slots per replica; None: a dead slot."""
        self.ready_at: list[float] = []
        """Wall time from which each replica runs (inf: it waits for a node)."""
        self.spares: list[str] = []
        self.notes: list[str] = []
        self.clock = CheckpointClock(job.checkpoint_interval, clock_offset)
        self._pending: list[Phase] = []
        self._pending_since = 0.0

    @property
    def full_rate(self) -> float:
        """Samples/s with every replica running (the job's checkpoint cost included)."""
        job = self.job
        return (
            job.global_batch
            / iteration_1f1b(job, job.stages, job.microbatches, job.pipelines)
            * (job.checkpoint_efficiency)
        )

    def running(self, at: float) -> int:
        """Replicas running at wall time ``at`` (the ones restarting count from their ready time)."""
        return sum(1 for r, t in zip(self.replicas, self.ready_at, strict=True) if None not in r and t <= at)

    def rate(self) -> float:
        return self.full_rate * self.running(math.inf) / self.job.pipelines

    # ----- the System protocol -----

    def start(self, nodes: Sequence[str]) -> list[Phase]:
        P, D = self.job.stages, self.job.pipelines
        nodes = list(nodes)
        self.replicas = [[None] * P for _ in range(D)]
        self.ready_at = [math.inf] * D
        for i, node in enumerate(nodes[: D * P]):
            self.replicas[i // P][i % P] = node
        for r in range(D):
            if None not in self.replicas[r]:
                self.ready_at[r] = 0.0
        self.spares = nodes[D * P :]
        self._fill(0.0)
        self._pending, self._pending_since = self._schedule(0.0, []), 0.0
        return self._pending

    def change(self, now: float, removed: Sequence[str], added: Sequence[str]) -> list[Phase]:
        kept = consume(self._pending, now - self._pending_since)[:-1]
        start = now + sum(p.duration for p in kept)
        gone = set(removed)
        self.spares = [n for n in self.spares if n not in gone]
        hit = 0
        for r, slots in enumerate(self.replicas):
            if any(n in gone for n in slots if n is not None):
                was_running = None not in slots and self.ready_at[r] <= now
                hit += was_running
                self.replicas[r] = [None if n in gone else n for n in slots]
                self.ready_at[r] = math.inf
        self.spares.extend(added)
        self._fill(now)
        head: list[Phase] = []
        if hit and self.running(now) == 0:
            lost = self.clock.lost(now)
            restart = self.job.checkpointing.restart_s
            self.notes.append("fatal: checkpoint restart")
            head = [Phase(lost, 0.0, "lost work"), Phase(restart, 0.0, "restart")]
            self.clock.pause(now, lost + restart, restart=True)
            self.ready_at = [max(t, now + lost + restart) for t in self.ready_at]
        elif hit:
            p = self.params
            step = self.job.global_batch / self.full_rate * self.job.checkpoint_efficiency
            head = [Phase(p.lost_iteration_fraction * step, 0.0, "lost work"), Phase(p.detect_s, 0.0, "detect")]
            self.notes += ["replica out"] * hit
            self.clock.pause(now, sum(h.duration for h in head), restart=False)
        phases = self._schedule(start, head)
        self._pending, self._pending_since = kept + phases, now
        return phases

    # ----- internals -----

    def _fill(self, now: float) -> None:
        """Put spare nodes into the dead slots of waiting replicas; each restarts ``restart_s`` later."""
        for r, slots in enumerate(self.replicas):
            if None not in slots or not self.spares:
                continue
            while None in slots and self.spares:
                slots[slots.index(None)] = self.spares.pop(0)
            if None not in slots:
                self.ready_at[r] = now + self.params.restart_s
                self.notes.append("replica restart")

    def _schedule(self, start: float, head: list[Phase]) -> list[Phase]:
        """``head`` from ``start``, then the rate stepping up at each replica's ready time."""
        t = start + sum(h.duration for h in head)
        phases = list(head)
        full, D = self.full_rate, self.job.pipelines
        for ready in sorted({r for r in self.ready_at if t < r < math.inf}):
            phases.append(Phase(ready - t, full * self.running(t) / D, "replica restart"))
            t = ready
        phases.append(Phase(math.inf, full * self.running(t) / D))
        return phases
