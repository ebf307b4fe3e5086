"""The planner's stated limits: the largest problems it accepts, and where it refuses the MILP.

Every limit is checked before any planning starts, and a refusal is a :class:`LimitError` whose
message names the quantity, its value and the allowed range. ``ds-recycle plan`` checks them
(docs/planner.md lists them with the reasons); library callers can call :func:`check_problem`
and :func:`check_costs` themselves.

Why these numbers (measured on the 2-core development machine, docs/planner.md):

- ``D <= 4096`` and ``m <= 65536``: far beyond any job (16,384 GPUs at P = 4 is D = 4096); they
  keep a plan's size, its cache key and its text Gantt bounded.
- ``P <= 1024``: far above any pipeline depth in use; keeps the text Gantt and the cache keys sane.
- ``3*D*P*m <= 1_000_000`` ops: the heuristic's time is about linear in the ops of the pipelines
  a failure set touches, plus a copy of every op (0.1-0.3 s for 6,144 ops at D=8, P=8, m=32; for
  786,432 ops 0.9 s CPU when few pipelines are touched, D=512, P=16, m=32 with one failure, and
  6 s when half are, D=128, P=32, m=64), so this bounds a plan to well under a minute.
- MILP: ``3*D*P*m <= 3072`` ops. Building the model is not bounded by ``--time-limit``: with two
  failures and a 2 s limit, 1,536 ops took 6 s to build, 3,072 ops 10 s, 6,144 ops 41 s (131k
  binaries) and 24,576 ops 8 minutes; above the limit use the heuristic (the MILP's warm start).
- PNG: at most 256 worker rows and 6,144 ops: matplotlib draws one patch per op (about 20 s for
  6,144 ops on a loaded machine).
- Durations F, B, W, comm and step: finite, 0 or in ``[1e-3, 1e6]``, and ``F + B + W > 0`` on
  every stage. NaN and infinity have no schedule; a dynamic range of 1e9 keeps every start time
  exact enough for the validator's tolerance (1e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_recycle.planner.plan import CostModel


class LimitError(ValueError):
    """A problem the planner refuses; the message names the quantity and the allowed range."""


@dataclass(frozen=True)
class PlannerLimits:
    max_pipelines: int = 4096
    max_stages: int = 1024
    max_microbatches: int = 65536
    max_ops: int = 1_000_000
    """Largest ``3*D*P*m`` (F, B and W of every micro-batch on every stage) the planner accepts."""
    max_milp_ops: int = 3072
    """Largest ``3*D*P*m`` for which the MILP is built; larger problems get the heuristic only."""
    max_png_ops: int = 6144
    max_png_rows: int = 256
    min_duration: float = 1e-3
    """Smallest positive duration; 0 is allowed too."""
    max_duration: float = 1e6
    max_time_limit: float = 3600.0
    """Longest MILP time limit, in seconds."""
    max_memory_cap: int = 65536
    """Largest memory cap (micro-batches a worker may hold); at least ``m`` means no cap in effect."""
    min_width: int = 10
    max_width: int = 10_000
    """Columns of the text Gantt."""
    max_cost_file_bytes: int = 64 << 10
    """A cost file of 1024 stages fits in 40 KiB; PyYAML parses 64 KiB in at most a few seconds."""
    max_cost_file_nesting: int = 16
    """Deepest nesting of brackets in a cost file (PyYAML takes seconds on thousands, libyaml crashes)."""


LIMITS = PlannerLimits()


def ops(pipelines: int, stages: int, microbatches: int) -> int:
    """F, B and W of every micro-batch of every pipeline on every stage."""
    return 3 * pipelines * stages * microbatches


def check_problem(
    pipelines: int, stages: int, microbatches: int, solver: str = "heuristic", limits: PlannerLimits = LIMITS
) -> None:
    """Raise LimitError unless D, P, m (and their product, for ``solver``) are within the limits."""
    for name, value, top in (
        ("D (pipelines)", pipelines, limits.max_pipelines),
        ("P (stages)", stages, limits.max_stages),
        ("m (micro-batches)", microbatches, limits.max_microbatches),
    ):
        if not 1 <= value <= top:
            raise LimitError(f"{name} = {value} is out of range: allowed 1..{top}")
    n = ops(pipelines, stages, microbatches)
    if n > limits.max_ops:
        raise LimitError(
            f"D={pipelines} P={stages} m={microbatches} is {n:,} ops (3*D*P*m); the planner accepts at most "
            f"{limits.max_ops:,}"
        )
    if solver == "milp" and n > limits.max_milp_ops:
        raise LimitError(
            f"D={pipelines} P={stages} m={microbatches} is {n:,} ops (3*D*P*m); the MILP is built only up to "
            f"{limits.max_milp_ops:,} ops: use the heuristic for larger problems"
        )


def check_duration(value: float, limits: PlannerLimits = LIMITS) -> str | None:
    """None for an allowed duration, else what is wrong with it (for a message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value):
        return f"{value!r} is not finite"
    if value != 0 and not limits.min_duration <= value <= limits.max_duration:
        return f"{value:g} is out of range"
    return None


def duration_range(limits: PlannerLimits = LIMITS) -> str:
    return f"allowed: 0 or [{limits.min_duration:g}, {limits.max_duration:g}]"


def check_costs(costs: CostModel, limits: PlannerLimits = LIMITS) -> None:
    """Raise LimitError unless every duration is allowed and every stage has some work."""
    for name in ("F", "B", "W"):
        for s, v in enumerate(getattr(costs, name)):
            problem = check_duration(v, limits)
            if problem:
                raise LimitError(f"cost {name}[{s}]: {problem}; {duration_range(limits)}")
    for name in ("comm", "step"):
        problem = check_duration(getattr(costs, name), limits)
        if problem:
            raise LimitError(f"cost {name}: {problem}; {duration_range(limits)}")
    for s in range(costs.stages):
        if costs.F[s] + costs.B[s] + costs.W[s] <= 0:
            raise LimitError(f"stage {s} has F + B + W = 0: every stage needs some work (a duration > 0)")


def check_png(pipelines: int, stages: int, microbatches: int, limits: PlannerLimits = LIMITS) -> None:
    rows, n = pipelines * stages, ops(pipelines, stages, microbatches)
    if rows > limits.max_png_rows or n > limits.max_png_ops:
        raise LimitError(
            f"a PNG of D={pipelines} P={stages} m={microbatches} ({rows} rows, {n:,} ops) is too large: allowed at "
            f"most {limits.max_png_rows} rows (D*P) and {limits.max_png_ops:,} ops (3*D*P*m)"
        )
