"""Failures by cause: the Llama 3 mix, node-wide failures, and repair times drawn from a distribution.

The Llama 3 report (Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783, Table 5) counts the
419 unexpected interruptions of 54 days of 405B pre-training on 16,384 H100s by root cause. Each cause
here keeps its count, so the mix is ``count / 419``. The table's printed share for "Faulty GPU" (30.1%)
does not match its count (148 / 419 = 35.3%) while every other share does; the counts, which sum to
419, are used.

Scope [A, the issue's rule]: a GPU-class failure (GPU, HBM3, SRAM, GSP, silent data corruption,
thermal) takes one GPU, hence its worker (a tensor-parallel group); a host, network or power failure
takes its whole node, ``gpus_per_node`` GPUs at once; a software failure (bug, NCCL watchdog,
dependency) takes one worker's process. A failure's repair time is drawn from a lognormal of the
class's mean: time to repair in large HPC systems is best fit by a lognormal (Schroeder and Gibson,
DSN 2006, "A large-scale study of failures in high-performance computing systems"): most repairs are
a reset or a reboot, a few wait for a part. The means and the spread are assumptions [A]
(docs/simulator.md, Sources).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from ds_recycle.sim.timeline import Event

SCOPES = ("gpu", "node")
KINDS = ("gpu", "host", "network", "software")


@dataclass(frozen=True)
class Cause:
    name: str
    count: int
    """Interruptions of this cause in Llama 3's 54 days (Table 5)."""
    kind: str
    """Repair class: one of ``KINDS``."""
    scope: str
    """``gpu``: one GPU (its worker); ``node``: every GPU of its node."""


LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty GPU", 148, "gpu", "gpu"),
    Cause("GPU HBM3 memory", 72, "gpu", "gpu"),
    Cause("software bug", 54, "software", "gpu"),
    Cause("network switch/cable", 35, "network", "node"),
    Cause("host maintenance", 32, "host", "node"),
    Cause("GPU SRAM memory", 19, "gpu", "gpu"),
    Cause("GPU system processor", 17, "gpu", "gpu"),
    Cause("NIC", 7, "network", "node"),
    Cause("NCCL watchdog timeout", 7, "software", "gpu"),
    Cause("silent data corruption", 6, "gpu", "gpu"),
    Cause("GPU thermal interface and sensor", 6, "gpu", "gpu"),
    Cause("SSD", 3, "host", "node"),
    Cause("power supply", 3, "host", "node"),
    Cause("server chassis", 2, "host", "node"),
    Cause("IO expansion board", 2, "host", "node"),
    Cause("dependency", 2, "software", "gpu"),
    Cause("CPU", 2, "host", "node"),
    Cause("system memory", 2, "host", "node"),
)
"""Llama 3 405B's 419 unexpected interruptions by cause (arXiv 2407.21783, Table 5)."""

REPAIR_MEAN_HOURS: dict[str, float] = {"gpu": 3.0, "host": 2.0, "network": 1.0, "software": 0.25}
"""Mean repair time per class [A]: a GPU is drained, reset or swapped and burnt in (3 h); a host is
rebooted or serviced (2 h); a link is re-routed or a cable swapped (1 h); a crashed process is
restarted on its node after a health check (15 min). The mix's mean is 2.3 h, near the single-cause
model's 2 h."""
REPAIR_SIGMA = 1.0
"""Standard deviation of the log of a repair time [A]: the median is 0.61 of the mean, one repair in
six takes over 1.6 times the mean."""


@dataclass(frozen=True)
class FailureModel:
    causes: tuple[Cause, ...] = LLAMA3_CAUSES
    repair_mean_hours: dict[str, float] = field(default_factory=lambda: dict(REPAIR_MEAN_HOURS))
    repair_sigma: float = REPAIR_SIGMA
    gpus_per_node: int = 8
    """GPUs a node-wide failure takes (an 8-GPU H100 host)."""

    def __post_init__(self) -> None:
        if not self.causes or sum(c.count for c in self.causes) <= 0:
            raise ValueError("failure model: needs at least one cause with a count > 0")
        for cause in self.causes:
            if cause.kind not in self.repair_mean_hours or cause.scope not in SCOPES or cause.count < 0:
                raise ValueError(f"failure model: cause {cause.name!r} has an unknown kind/scope or a count < 0")
        for kind, mean in self.repair_mean_hours.items():
            if not (math.isfinite(mean) and mean >= 0):
                raise ValueError(f"failure model: repair mean of {kind} = {mean!r} must be a finite number >= 0")
        if not (math.isfinite(self.repair_sigma) and self.repair_sigma >= 0):
            raise ValueError(f"failure model: repair_sigma = {self.repair_sigma!r} must be a finite number >= 0")
        if self.gpus_per_node < 1:
            raise ValueError(f"failure model: gpus_per_node = {self.gpus_per_node} must be >= 1")

    def shares(self) -> dict[str, float]:
        total = sum(c.count for c in self.causes)
        return {c.name: c.count / total for c in self.causes}

    def workers_per_node(self, tp: int) -> int:
        """Workers (tensor-parallel groups of ``tp`` GPUs) a node holds: at least one [A: a group
        wider than a node is lost whole with any of its nodes]."""
        return max(1, self.gpus_per_node // tp)

    def draw_repair_s(self, kind: str, rng: random.Random) -> float:
        mean = self.repair_mean_hours[kind] * 3600.0
        if mean == 0 or self.repair_sigma == 0:
            return mean
        mu = math.log(mean) - self.repair_sigma**2 / 2
        return rng.lognormvariate(mu, self.repair_sigma)


@dataclass
class CauseEvents:
    """What :func:`cause_events` drew, for the study's config and the tests."""

    initial: list[str]
    events: list[Event]
    by_cause: dict[str, int]
    """Failures (interruptions) per cause."""
    removed_per_failure: list[int]
    """Workers each failure removed, in order."""
    repair_s: list[float]
    """Each failure's drawn repair time."""


def cause_events(
    workers: int,
    spares: int,
    tp: int,
    rate_per_gpu_hour: float,
    hours: float,
    model: FailureModel,
    seed: int,
) -> CauseEvents:
    """Initial workers (the job's, then the spares, ``workers_per_node`` consecutive ones per node)
    and the failure/repair events. Failures come at ``rate_per_gpu_hour`` per live GPU; each draws a
    cause by its share: a GPU-scope one removes one live worker, a node-scope one every live worker of
    the node that holds a randomly chosen live GPU. The removed workers come back together as one new
    node (new names) after the drawn repair time."""
    rng = random.Random(seed)
    per_node = model.workers_per_node(tp)
    causes = list(model.causes)
    weights = [c.count for c in causes]
    initial = [f"n{i}" for i in range(workers + spares)]
    node_of: dict[str, int] = {n: i // per_node for i, n in enumerate(initial)}
    members: dict[int, set[str]] = {}
    for n, k in node_of.items():
        members.setdefault(k, set()).add(n)
    live = list(initial)
    position = {n: i for i, n in enumerate(live)}
    serial = len(initial)
    repairs: list[tuple[float, int, int, int]] = []
    """(time, order, node, workers it gets back)."""
    out = CauseEvents(initial, [], {c.name: 0 for c in causes}, [], [])
    horizon = hours * 3600.0
    now = 0.0
    while True:
        total = rate_per_gpu_hour * len(live) * tp / 3600.0
        wait = rng.expovariate(total) if total > 0 else math.inf
        if repairs and repairs[0][0] <= now + wait:
            now, _, node, count = heapq.heappop(repairs)
            if now >= horizon:
                break
            for _ in range(count):
                name = f"n{serial}"
                serial += 1
                node_of[name] = node
                members[node].add(name)
                position[name] = len(live)
                live.append(name)
                out.events.append(Event(now, "add", name))
            continue
        now += wait
        if now >= horizon:
            break
        cause = rng.choices(causes, weights)[0]
        hit = live[rng.randrange(len(live))]
        node = node_of[hit]
        victims = [hit] if cause.scope == "gpu" else sorted(members[node])
        for victim in victims:
            i = position.pop(victim)
            last = live.pop()
            if last != victim:
                live[i] = last
                position[last] = i
            members[node].discard(victim)
            out.events.append(Event(now, "remove", victim))
        repair = model.draw_repair_s(cause.kind, rng)
        heapq.heappush(repairs, (now + repair, len(out.repair_s), node, len(victims)))
        out.by_cause[cause.name] += 1
        out.removed_per_failure.append(len(victims))
        out.repair_s.append(repair)
    return out
