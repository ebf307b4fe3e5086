"""Measured costs: the planner's CostModel from the instruction events, and stragglers.

Every worker keeps the durations of its F, B, W and step (``StaggeredStep``) over its last
``recycle.profile.window`` completed iterations (:class:`OpTimes`). Every ``interval`` iterations,
and at the first iteration of every membership epoch, at the start of the iteration, the live
workers agree on them in an all-reduce over the world (:func:`agree`): each writes its own row
(its medians) of a ``D*P`` table and zeros elsewhere, so the sum is every row exactly, on every
rank, whatever the reduction order; the same table carries every worker's cost tracker state, and
every rank takes that of one worker (so that a joiner, or a rank whose last agreement completed
while a peer's failed, holds the same state as the others). From that every rank derives the same
:class:`AgreedProfile` and the same decision (:class:`CostTracker`), so every rank switches to the same plan at the same
iteration.

A stage's cost of a kind is the lower median of its replicas' medians (the faster of two, the
second of four), so that one slow replica does not set its stage's cost. A worker's slowdown is
its F + B + W against the lower median of its stage peers', once it and they were measured over a
full window (fewer iterations on a busy host are noise); above ``recycle.stragglers.threshold``
for ``patience`` agreements in a row it is planned as a straggler (``CostModel.slow``), and below
``1 + (threshold - 1) / 2`` for as many it is released. Being slow never fails a worker. Costs
that drift beyond ``recycle.profile.drift`` in two agreements in a row re-plan.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ds_recycle.config import ProfileConfig, StragglerConfig
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.planner.plan import CostModel, Worker

EVENT_KINDS = {"ForwardPass": "F", "BackwardInput": "B", "BackwardWeight": "W", "StaggeredStep": "S"}
KINDS = ("F", "B", "W", "S")
ROW = 2 * len(KINDS) + 1
"""A worker's row of the agreed table (milliseconds): its median F, B, W, S, their lower quartiles,
and its iteration count."""
COUNT = ROW - 1
DRIFT_PATIENCE = 2
"""Agreements in a row whose costs drifted before a re-plan: one delayed op on a busy host is no drift."""
QUARTILE = len(KINDS)


class OpTimes:
    """One worker's op durations (milliseconds) over its last ``window`` completed iterations."""

    def __init__(self, window: int) -> None:
        self.iterations: deque[dict[str, list[float]]] = deque(maxlen=window)

    def record(self, events: Iterable[InstructionEvent]) -> None:
        durations: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for event in events:
            kind = EVENT_KINDS.get(event.name)
            if kind is not None:
                durations[kind].append(1000.0 * (event.end - event.start))
        self.iterations.append(durations)

    def clear(self) -> None:
        self.iterations.clear()

    def row(self) -> list[float]:
        if not self.iterations:
            return [0.0] * ROW
        medians, quartiles = [], []
        for kind in KINDS:
            values = sorted(v for durations in self.iterations for v in durations[kind])
            medians.append(statistics.median(values) if values else 0.0)
            quartiles.append(values[(len(values) - 1) // 4] if values else 0.0)
        return medians + quartiles + [float(len(self.iterations))]


def exchange(
    row: list[float], worker: Worker, pipelines: int, stages: int, all_reduce, device: object = "cpu"
) -> list[list[float]]:
    """Every live worker's row, by ``pipeline * stages + stage``: ``all_reduce(tensor)`` sums the
    table in place (each rank fills only its own row, so the sum is exact on every rank)."""
    return exchange_sections([row], worker, pipelines, stages, all_reduce, device)[0]


def exchange_sections(
    rows: list[list[float]], worker: Worker, pipelines: int, stages: int, all_reduce, device: object = "cpu"
) -> list[list[list[float]]]:
    """:func:`exchange` of several rows side by side in one all-reduce: one table per row."""
    widths = [len(row) for row in rows]
    table = torch.zeros(pipelines * stages, sum(widths), dtype=torch.float64, device=device)
    table[worker[0] * stages + worker[1]] = torch.tensor([v for row in rows for v in row], dtype=torch.float64)
    all_reduce(table)
    whole = table.tolist()
    tables, start = [], 0
    for width in widths:
        tables.append([r[start : start + width] for r in whole])
        start += width
    return tables


def agreement_row(tracker: CostTracker, times: list[float], pipelines: int) -> list[float]:
    """This worker's part of a cost agreement: its measured row, whether its tracker took part in
    an agreement before, and the tracker's state."""
    return [*times, 1.0 if tracker.exchanges else 0.0, *tracker.state(pipelines)]


def take_agreement(tracker: CostTracker, table: list[list[float]], pipelines: int, stages: int) -> AgreedProfile:
    """The agreement in ``table`` (every worker's :func:`agreement_row`): every rank loads the tracker
    state of the lowest worker that has taken part in an agreement before, so that a process that
    joined (fresh state), or one whose last agreement completed while a peer's failed (one update
    ahead), takes it over and the trackers never stay apart."""
    leaders = [r for r in table if r[ROW] > 0]
    if leaders:
        tracker.load_state(leaders[0][ROW + 1 :], pipelines)
    rows = [r[:ROW] for r in table]
    return AgreedProfile.from_table(rows, pipelines, stages, tracker.stragglers, judged_after=tracker.config.window)


def agree(
    tracker: CostTracker, row: list[float], worker: Worker, pipelines: int, stages: int, all_reduce, device="cpu"
) -> AgreedProfile:
    """One agreement on its own (one all-reduce): every live worker's measurements, and the cost
    tracker's state, which every rank then holds identically (:func:`take_agreement`)."""
    table = exchange(agreement_row(tracker, row, pipelines), worker, pipelines, stages, all_reduce, device)
    return take_agreement(tracker, table, pipelines, stages)


def _lower_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _round(value: float) -> float:
    """Three significant digits, so that noise below 1% never changes a cost model."""
    return float(f"{value:.3g}")


@dataclass(frozen=True)
class AgreedProfile:
    """Per-stage costs and per-worker slowdowns, the same on every rank (from one table)."""

    F: dict[int, float]
    B: dict[int, float]
    W: dict[int, float]
    S: dict[int, float]
    """Stages with a measurement only; a stage's S is its fastest replica's (the others wait for it)."""
    slowdown: dict[Worker, float]
    """Each measured worker's F + B + W against the lower median of its stage peers' (1.0 alone),
    from lower quartiles: a busy host only ever delays an op, a straggler delays every op. Only
    workers measured over ``judged_after`` iterations, against peers measured as long."""

    @classmethod
    def from_table(
        cls,
        table: list[list[float]],
        pipelines: int,
        stages: int,
        stragglers: dict[Worker, float] | None = None,
        judged_after: int = 1,
    ) -> AgreedProfile:
        """``stragglers``: the workers planned as stragglers and their factors. A stage's costs come
        from its other replicas; from a straggler's measurements divided by its factor only when no
        other replica of the stage was measured (its peers failed), and a worker without a
        measured peer has no slowdown (nothing to compare with: it is neither detected nor
        released). ``judged_after``: the iterations a worker's row must span for its slowdown to
        be taken (the engine's: a full window; the medians of one or two iterations on a busy host
        are noise)."""
        stragglers = stragglers or {}
        F: dict[int, float] = {}
        B: dict[int, float] = {}
        W: dict[int, float] = {}
        S: dict[int, float] = {}
        slowdown: dict[Worker, float] = {}
        for s in range(stages):
            rows = {p: table[p * stages + s] for p in range(pipelines) if table[p * stages + s][COUNT] > 0}
            if not rows:
                continue
            normal = {p: r for p, r in rows.items() if (p, s) not in stragglers}
            scaled = normal or {p: [v / stragglers[(p, s)] for v in r[:3]] + r[3:] for p, r in rows.items()}
            F[s] = _round(_lower_median([r[0] for r in scaled.values()]))
            B[s] = _round(_lower_median([r[1] for r in scaled.values()]))
            W[s] = _round(_lower_median([r[2] for r in scaled.values()]))
            S[s] = _round(min(r[3] for r in rows.values()))
            work = {p: sum(r[QUARTILE : QUARTILE + 3]) for p, r in rows.items() if r[COUNT] >= judged_after}
            for p in work:
                peers = [w for o, w in work.items() if o != p]
                reference = _lower_median(peers) if peers else 0.0
                if reference > 0:
                    slowdown[(p, s)] = round(work[p] / reference, 3)
        return cls(F, B, W, S, slowdown)

    @property
    def complete_for(self) -> int:
        return len(self.F)


@dataclass(frozen=True)
class StragglerChange:
    worker: Worker
    detected: bool
    """True: newly planned as a straggler (or its factor re-measured); False: released."""
    slowdown: float


@dataclass
class CostDecision:
    costs: CostModel | None
    """The new cost model, or None to keep the one in use."""
    reasons: list[str] = field(default_factory=list)
    changes: list[StragglerChange] = field(default_factory=list)


class CostTracker:
    """The cost model in use and the straggler state; :meth:`update` with each agreed profile.

    Deterministic in its inputs, so every rank that feeds it the same profiles holds the same
    cost model."""

    def __init__(
        self,
        base: CostModel,
        profile: ProfileConfig,
        stragglers: StragglerConfig,
        measured: bool = False,
        straggler_stages: Iterable[int] | None = None,
    ) -> None:
        self.in_use = base
        self.config = profile
        self.straggler_config = stragglers
        self.measured = measured
        """False while the model in use is not a measurement (unit costs): the first complete
        profile is taken whatever its drift. True for a model of real durations (emulated)."""
        self.straggler_stages = None if straggler_stages is None else set(straggler_stages)
        """Stages whose stragglers can be routed around (None: all)."""
        self.above: dict[Worker, int] = {}
        self.below: dict[Worker, int] = {}
        self.stragglers: dict[Worker, float] = dict(base.stragglers())
        self.last: AgreedProfile | None = None
        self.exchanges = 0
        """Agreements this tracker took part in."""
        self.drifting = 0
        """Consecutive agreements whose costs drifted beyond ``profile.drift``."""

    def state(self, pipelines: int) -> list[float]:
        """Everything :meth:`update` depends on, as numbers (:meth:`load_state` reads it back)."""
        costs, P = self.in_use, self.in_use.stages
        workers = [(p, s) for p in range(pipelines) for s in range(P)]
        return [
            float(self.measured),
            float(self.exchanges),
            float(self.drifting),
            *costs.F,
            *costs.B,
            *costs.W,
            costs.comm,
            costs.step,
            *(self.stragglers.get(w, 0.0) for w in workers),
            *(float(self.above.get(w, 0)) for w in workers),
            *(float(self.below.get(w, 0)) for w in workers),
        ]

    def load_state(self, state: list[float], pipelines: int) -> None:
        P = self.in_use.stages
        workers = [(p, s) for p in range(pipelines) for s in range(P)]
        n = len(workers)
        self.measured, self.exchanges, self.drifting = bool(state[0]), int(state[1]), int(state[2])
        F, B, W = (tuple(state[3 + i * P : 3 + (i + 1) * P]) for i in range(3))
        comm, step = state[3 + 3 * P], state[4 + 3 * P]
        rest = state[5 + 3 * P :]
        self.stragglers = {w: f for w, f in zip(workers, rest[:n], strict=True) if f > 0}
        self.above = {w: int(c) for w, c in zip(workers, rest[n : 2 * n], strict=True) if c}
        self.below = {w: int(c) for w, c in zip(workers, rest[2 * n :], strict=True) if c}
        slow = tuple((p, s, f) for (p, s), f in self.stragglers.items())
        self.in_use = CostModel(F, B, W, comm, step, slow)

    @property
    def release_level(self) -> float:
        return 1.0 + (self.straggler_config.threshold - 1.0) / 2.0

    def update(self, profile: AgreedProfile) -> CostDecision:
        self.last = profile
        self.exchanges += 1
        current = self.in_use
        stages = current.stages
        decision = CostDecision(None)
        F, B, W = list(current.F), list(current.B), list(current.W)
        step = current.step
        if profile.complete_for == stages:
            measured_step = max(profile.S.values())
            candidate = (
                tuple(profile.F[s] for s in range(stages)),
                tuple(profile.B[s] for s in range(stages)),
                tuple(profile.W[s] for s in range(stages)),
            )
            drift = self._drift(current, candidate)
            self.drifting = self.drifting + 1 if drift > self.config.drift else 0
            if not self.measured or self.drifting >= DRIFT_PATIENCE:
                self.drifting = 0
                F, B, W = (list(c) for c in candidate)
                step = measured_step
                decision.reasons.append(
                    "first measured profile" if not self.measured else f"measured costs drifted {drift:.0%}"
                )
                self.measured = True
        if self.straggler_config.enabled:
            self._track_stragglers(profile, decision)
        if decision.reasons and profile.complete_for == stages:
            step = measured_step
        costs = CostModel(
            tuple(F), tuple(B), tuple(W), current.comm, step, tuple((p, s, f) for (p, s), f in self.stragglers.items())
        )
        if decision.reasons:
            decision.costs = costs
            self.in_use = costs
        return decision

    def _drift(self, current: CostModel, candidate: tuple) -> float:
        """The largest relative change of a stage's F, B or W (against the larger of its value in
        use and a tenth of the stage's F + B + W, so that a tiny W's noise does not count). The
        step is not weighed: it only shifts the predicted time, never the plan, and it holds the
        wait for the stage's slowest replica, which varies from one iteration to the next; it is
        taken along whenever F, B or W re-plan."""
        worst = 0.0
        for s in range(current.stages):
            total = current.F[s] + current.B[s] + current.W[s]
            for kind, values in zip((current.F, current.B, current.W), candidate, strict=True):
                worst = max(worst, abs(values[s] - kind[s]) / max(kind[s], total / 10, 1e-9))
        return worst

    def _track_stragglers(self, profile: AgreedProfile, decision: CostDecision) -> None:
        config = self.straggler_config
        for worker, ratio in sorted(profile.slowdown.items()):
            if self.straggler_stages is not None and worker[1] not in self.straggler_stages:
                continue
            if ratio >= config.threshold:
                self.above[worker] = self.above.get(worker, 0) + 1
                self.below[worker] = 0
            elif ratio < self.release_level:
                self.below[worker] = self.below.get(worker, 0) + 1
                self.above[worker] = 0
            else:
                self.above[worker] = self.below[worker] = 0
            factor = round(ratio, 2)
            planned = self.stragglers.get(worker)
            if planned is None and self.above[worker] >= config.patience:
                self.stragglers[worker] = factor
                decision.changes.append(StragglerChange(worker, True, ratio))
                decision.reasons.append(f"straggler {worker} at {ratio:.2f}x")
            elif planned is not None and self.below[worker] >= config.patience:
                del self.stragglers[worker]
                decision.changes.append(StragglerChange(worker, False, ratio))
                decision.reasons.append(f"straggler {worker} released at {ratio:.2f}x")
            elif (
                planned is not None
                and ratio >= config.threshold
                and abs(factor - planned) > self.config.drift * planned
            ):
                self.stragglers[worker] = factor
                decision.changes.append(StragglerChange(worker, True, ratio))
                decision.reasons.append(f"straggler {worker} re-measured at {ratio:.2f}x (was {planned:.2f}x)")


@dataclass(frozen=True)
class CostChange:
    """One re-plan from measured costs, as the engine logged it."""

    iteration: int
    reasons: tuple[str, ...]
    costs: CostModel
    changes: tuple[StragglerChange, ...]
    predicted: float
    """The new plan's predicted iteration time (the cost model's unit: milliseconds once measured)."""
    fault_free: float
    """The fault-free plan's on the new costs without stragglers."""
    doing_nothing: float
    """The previous plan's order re-timed on the new costs."""
