"""The physical lower bound a plan's iteration time is judged against.

Notation: stage ``s`` has ``n_s = D - f_s`` live workers and, with the usual unit of work being one
micro-batch's F+B+W on one worker, the D*m micro-batches of stage s must be split among them, so
its busiest worker runs at least ``k_s = ceil(D*m / n_s)`` micro-batches (F, B and W of a
micro-batch share a worker). Let ``F_s, B_s, W_s`` be the durations, ``c`` the p2p latency,
``S`` the step, and ``C`` the memory cap. Consecutive stages are always on different workers, so
every stage boundary costs ``c``.

Fill. No op of stage s can start before its first forward input has crossed stages 0..s-1::

    fill_s = sum_{j<s} (F_j + c)

Round trip. A B of stage s needs its own F to have gone down and its gradient to come back::

    R_s = F_s + sum_{j>s} (F_j + B_j) + 2 (P-1-s) c

Bound 1 (work and the warm-up bubble). Let t0 >= fill_s be the first op of the busiest worker
(an F). Every B starts at least R_s after its own F, so none before t0 + R_s, and no W either;
in [t0, t0 + R_s) the worker can only run forwards, and at most min(C, k_s) of them since no W
can free memory before then. Its k_s(F_s+B_s+W_s) of work therefore ends no earlier than
t0 + max(0, R_s - min(C, k_s) F_s) + k_s (F_s+B_s+W_s), and its S follows::

    LB1_s = fill_s + max(0, R_s - min(C, k_s) F_s) + k_s (F_s + B_s + W_s) + S

Bound 2 (the backward drain). When the busiest worker starts its last F it holds at most C
micro-batches, so at least k_s - C of its W have ended; all its F and B end by its last B,
which therefore ends no earlier than fill_s + (idle as above) + k_s (F_s+B_s) + max(0, k_s-C) W_s.
After that last B come its own W and, for s > 0, the gradient's way down to stage 0 and the W
there, then a step::

    tail_s = max(W_s, sum_{j<s} (c + B_j) + W_0)      (W_s alone when s = 0)
    LB2_s = fill_s + max(0, R_s - min(C, k_s) F_s) + k_s (F_s + B_s) + max(0, k_s - C) W_s + tail_s + S

Bound 3 (the last forward's round trip). Let e be the end of the busiest worker's last F. When
that F starts the worker holds at most C micro-batches, so at least ``max(0, k_s - C)`` of its W,
and their B, have ended; if ``k_s > C`` that last F also starts after t0 + R_s (the (C+1)-th F
waits for a W, hence for a B), so the warm-up idle time of bound 1 lies before e. Hence
``e >= t0 + idle + k_s F_s + max(0, k_s - C) (B_s + W_s)``, where idle is the warm-up idle time of
bound 1 when ``k_s > C`` and 0 otherwise. The B of that last micro-batch starts no earlier than
``e - F_s + R_s``; after it come its W and the gradient's way down (``tail_s``), then a step::

    LB3_s = fill_s + idle + k_s F_s + max(0, k_s - C) (B_s + W_s) + (R_s - F_s) + B_s + tail_s + S

When ``k_s > C`` it is above bound 1 exactly when ``R_s - F_s + B_s + tail_s > C (B_s + W_s)``:
the B and W work that the memory cap leaves for the end cannot cover the last round trip.
Example: GPT-3 13B presets on 4 pipelines x 4 stages, m = 8, cap 4, one failure in each of
stages 0..2: bounds 1 and 2 give 1585.0 ms, bound 3 gives 1590.3 ms, and a schedule of 1590.3 ms
exists (found by an exact CP-SAT model of the same rules outside this package, and by the MILP
in bench/planner.py), so there bound 3 is exact.

The lower bound is the maximum over stages and the three bounds; since a stage with no failure has
k_s = m, it is never below the fault-free bound (the same formula with no failures), which is
also taken explicitly. A plan that is not decoupled or not staggered is still a plan, so the bound
holds for every ScheduleOptions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ds_recycle.planner.plan import CostModel, Worker
from ds_recycle.planner.request import PlanRequest


class NoSurvivorError(ValueError):
    """Every worker of some stage has failed: ReCycle cannot re-route, the job needs a checkpoint."""


def check_survivors(pipelines: int, stages: int, failed: Iterable[Worker]) -> dict[int, int]:
    """Validate a failure set and return the number of failed workers per stage."""
    per_stage: dict[int, int] = {s: 0 for s in range(stages)}
    seen = set()
    for worker in failed:
        p, s = worker
        if not (0 <= p < pipelines and 0 <= s < stages):
            raise ValueError(f"failed worker ({p}, {s}) is outside the grid of {pipelines} pipelines x {stages} stages")
        if (p, s) in seen:
            continue
        seen.add((p, s))
        per_stage[s] += 1
    for s, f in per_stage.items():
        if f >= pipelines:
            raise NoSurvivorError(
                f"stage {s} has no live worker left (all {pipelines} failed): no functional redundancy, "
                "needs checkpoint fallback"
            )
    return per_stage


@dataclass(frozen=True)
class BoundParts:
    """The three bounds of the module docstring, each maximized over stages (and over the failure
    set and the fault-free grid); the lower bound is the largest."""

    work: float
    """Bound 1: the busiest worker's work plus the warm-up bubble."""
    drain: float
    """Bound 2: the backward drain after the busiest worker's last B."""
    round_trip: float
    """Bound 3: the last forward's round trip under the memory cap."""

    @property
    def value(self) -> float:
        return max(self.work, self.drain, self.round_trip)

    @property
    def binding(self) -> str:
        """Which bound gives the value (the first of work, drain, round_trip on a tie)."""
        return max(("work", "drain", "round_trip"), key=lambda name: getattr(self, name))


def lower_bound(
    pipelines: int,
    stages: int,
    microbatches: int,
    failed: Iterable[Worker] = (),
    costs: CostModel | None = None,
    memory_cap: int | None = None,
) -> float:
    """A lower bound on the iteration time of any valid plan (see the module docstring).
    ``memory_cap`` defaults to ``stages``, the planner's default cap."""
    return lower_bound_parts(pipelines, stages, microbatches, failed, costs, memory_cap).value


def lower_bound_parts(
    pipelines: int,
    stages: int,
    microbatches: int,
    failed: Iterable[Worker] = (),
    costs: CostModel | None = None,
    memory_cap: int | None = None,
) -> BoundParts:
    """:func:`lower_bound` split into its three bounds."""
    return bound_parts(PlanRequest(pipelines, stages, microbatches, failed, costs, memory_cap))


def bound_parts(request: PlanRequest) -> BoundParts:
    """:func:`lower_bound_parts` of a :class:`PlanRequest` (its schedule options do not matter)."""
    D, P, m, costs, cap = request.pipelines, request.stages, request.microbatches, request.costs, request.memory_cap
    f_per_stage = check_survivors(D, P, request.failed)
    bound = _bound(D, P, m, f_per_stage, costs, cap)
    fault_free = _bound(D, P, m, dict.fromkeys(range(P), 0), costs, cap)
    return BoundParts(*(max(a, b) for a, b in zip(bound, fault_free, strict=True)))


def _bound(
    D: int, P: int, m: int, f_per_stage: dict[int, int], costs: CostModel, cap: int
) -> tuple[float, float, float]:
    """(bound 1, bound 2, bound 3), each the maximum over stages."""
    F, B, W, c = costs.F, costs.B, costs.W, costs.comm
    work = drain = round_trip_bound = 0.0
    for s in range(P):
        k = math.ceil(D * m / (D - f_per_stage[s]))
        fill = sum(F[j] + c for j in range(s))
        round_trip = F[s] + sum(F[j] + B[j] for j in range(s + 1, P)) + 2 * (P - 1 - s) * c
        warmup_idle = max(0.0, round_trip - min(cap, k) * F[s])
        lb1 = fill + warmup_idle + k * (F[s] + B[s] + W[s]) + costs.step
        tail = W[s] if s == 0 else max(W[s], sum(c + B[j] for j in range(s)) + W[0])
        lb2 = fill + warmup_idle + k * (F[s] + B[s]) + max(0, k - cap) * W[s] + tail + costs.step
        # bound 3: the warm-up idle time lies before the last F only when k > cap
        drain_idle = warmup_idle if k > cap else 0.0
        after_last_f = (round_trip - F[s]) + B[s] + tail
        lb3 = fill + drain_idle + k * F[s] + max(0, k - cap) * (B[s] + W[s]) + after_last_f + costs.step
        work, drain, round_trip_bound = max(work, lb1), max(drain, lb2), max(round_trip_bound, lb3)
    return work, drain, round_trip_bound
