"""Re-shaping ReCycle's grid at an iteration boundary when failures have unbalanced it.

ReCycle's iteration follows its slowest stage, and a stage's time is its work divided among its
live workers: a stage that has lost ``k`` of its ``D`` workers makes every other stage wait. Two
re-shapes move work and workers back into balance without a checkpoint (docs/simulator.md):

- **migration**: a survivor of a stage with workers to spare leaves its slot and re-joins a dead
  slot of a stage short of workers through the join path, copying that stage's weights and
  optimizer state from a live replica. The failure set changes; the live workers, the global batch
  and the math do not (every micro-batch still runs every stage once per iteration);
- **re-partitioning**: stage boundaries move so that each stage's layers follow its live workers;
  every worker copies the layers it gains from a live replica of the stage that held them.

:class:`Rebalancer` proposes the candidate re-shapes of a mode, each with its steady period from the
planner (the same ``period`` ReCycle runs on) and its copy time; :func:`pays` keeps the best one
only if its gain over the expected repair time (``sim/repair.py``) pays for its pause.

Copy model [A]: a worker copies ``state_bytes_per_param`` (16 B) per parameter it gains, the same
figure as a re-join, over its own link (``Hardware.network_bandwidth``, 50 GB/s per GPU); copies
run in parallel, a source serving one receiver at a time (a stage whose ``k`` receivers have ``n``
sources takes ``ceil(k / n)`` rounds). The pause adds one group rebuild and a plan lookup (the
``rebuild_s`` and ``lookup_s`` of ReCycle's recovery).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds_recycle.planner import migration
from ds_recycle.planner.migration import Move
from ds_recycle.planner.plan import Worker
from ds_recycle.sim.cost_model import head_layer_ratio
from ds_recycle.sim.job import Job

MODES = ("off", "migrate", "repartition")
"""``off``: the fixed grid; ``migrate``: migration only; ``repartition``: migration and/or
re-partitioning, whichever the planner predicts best."""

Failed = tuple[Worker, ...]
Split = tuple[int, ...]
PeriodFn = Callable[[Failed, Split], "float | None"]
"""Steady-state seconds per iteration of ``(failed, layers)``; None: it cannot run."""


@dataclass(frozen=True)
class RebalanceParams:
    mode: str = "off"
    min_gain: float = 0.01
    """Smallest relative rise of the steady rate worth a pause [A]: below it the move is churn."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rebalance mode {self.mode!r}: one of {', '.join(MODES)}")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ValueError(f"rebalance: min_gain = {self.min_gain!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Reshape:
    """A candidate re-shape of the grid and what the planner predicts for it."""

    moves: tuple[Move, ...]
    layers: Split
    """Decoder layers per stage after it."""
    failed: Failed
    """Dead slots after it (as many as before)."""
    period_s: float
    copy_s: float
    """Seconds of its state copies (in parallel); the pause adds the group rebuild."""
    layers_changed: bool = False
    """Whether it moves stage boundaries."""

    @property
    def kind(self) -> str:
        """``migrate``, ``repartition`` or ``migrate+repartition``."""
        parts = (["migrate"] if self.moves else []) + (["repartition"] if self.layers_changed else [])
        return "+".join(parts) or "none"


def pays(period_now: float, period_new: float, pause_s: float, horizon_s: float, min_gain: float) -> bool:
    """Whether running at ``period_new`` after a pause of ``pause_s`` yields more samples than
    staying at ``period_now`` over the expected repair time ``horizon_s``, and the rate rises by
    at least ``min_gain``: ``(H - pause) / period_new > H / period_now``."""
    if not period_new > 0 or period_now / period_new < 1 + min_gain:
        return False
    return (horizon_s - pause_s) / period_new > horizon_s / period_now


class Rebalancer:
    def __init__(self, job: Job, params: RebalanceParams, period: PeriodFn):
        self.job = job
        self.params = params
        self.period = period
        self.head = head_layer_ratio(job.model)

    # ----- the candidates -----

    def candidates(self, failed: Failed, layers: Split) -> list[Reshape]:
        """The re-shapes of the mode that can run, the current grid excluded."""
        if self.params.mode == "off":
            return []
        failed = tuple(sorted(failed))
        out: list[Reshape] = []
        moves, moved = self.migrate(failed, self.work(layers))
        if moves:
            out += self._reshape(failed, layers, moves, moved, layers)
        if self.params.mode == "repartition":
            out += self._reshape(failed, layers, (), failed, self.split(self.live(failed)))
            even = self.even_counts(self.live(failed), self.work(layers))
            moves, moved = self.migrate(failed, self.work(layers), even)
            out += self._reshape(failed, layers, moves, moved, self.split(self.live(moved)))
        seen: set[tuple[Failed, Split]] = set()
        unique = []
        for r in out:
            if (r.failed, r.layers) not in seen and (r.failed, r.layers) != (failed, layers):
                seen.add((r.failed, r.layers))
                unique.append(r)
        return unique

    def best(self, failed: Failed, layers: Split) -> Reshape | None:
        """The candidate with the shortest period (ties: the fewest moves), or None."""
        options = self.candidates(failed, layers)
        return min(options, key=lambda r: (r.period_s, len(r.moves), r.copy_s)) if options else None

    def _reshape(
        self, failed: Failed, layers: Split, moves: tuple[Move, ...], moved: Failed, split: Split
    ) -> list[Reshape]:
        period = self.period(moved, split)
        if period is None:
            return []
        copy = self.copy_s(failed, layers, moves, moved, split)
        return [Reshape(moves, split, moved, period, copy, split != layers)]

    # ----- counts and work -----

    def live(self, failed: Sequence[Worker]) -> list[int]:
        """Live workers per stage."""
        return migration.live_per_stage(self.job.pipelines, self.job.stages, failed)

    def work(self, layers: Split) -> list[float]:
        """Each stage's compute in decoder layers (the LM head counted on the last)."""
        last = len(layers) - 1
        return [n + (self.head if s == last else 0.0) for s, n in enumerate(layers)]

    def needed(self, live: Sequence[int], work: Sequence[float]) -> list[int]:
        """:func:`ds_recycle.planner.migration.needed` for this job's ``D``."""
        return migration.needed(self.job.pipelines, live, work)

    def even_counts(self, live: Sequence[int], work: Sequence[float]) -> list[int]:
        """Live workers as even as possible over the stages (the extra ones to the heaviest)."""
        base, extra = divmod(sum(live), len(live))
        heaviest = sorted(range(len(live)), key=lambda s: (-work[s], s))[:extra]
        return [base + (1 if s in heaviest else 0) for s in range(len(live))]

    # ----- migration -----

    def migrate(
        self, failed: Failed, work: Sequence[float], target: Sequence[int] | None = None
    ) -> tuple[tuple[Move, ...], Failed]:
        """The fewest moves that give each stage at least its ``target`` live workers (default:
        :meth:`needed`), and the failure set after them (:func:`ds_recycle.planner.migration.migrate`)."""
        return migration.migrate(self.job.pipelines, self.job.stages, failed, work, target)

    # ----- re-partitioning -----

    def split(self, live: Sequence[int]) -> Split:
        """Decoder layers per stage that minimize ``max (layers_s + head_s) / live_s``, layers
        moving only out of stages with fewer live workers than the fullest and into the fullest
        ones (each keeping at least one): the re-partition undoes the failures' imbalance, not the
        job's own split (which, even with every worker alive, is not the best for the LM head).
        With as many workers in every stage it is the job's split."""
        default = self.job.layout.layers
        most = max(live)
        low = [1 if n < most else layers for n, layers in zip(live, default, strict=True)]
        high = [layers if n < most else self.job.model.layers for n, layers in zip(live, default, strict=True)]
        last = len(live) - 1
        split = list(low)
        for _ in range(self.job.model.layers - sum(low)):
            open_ = [s for s in range(len(live)) if split[s] < high[s]]
            s = min(open_, key=lambda s: ((split[s] + 1 + (self.head if s == last else 0.0)) / live[s], s))
            split[s] += 1
        return tuple(split)

    # ----- the cost -----

    def copy_s(self, failed: Failed, layers: Split, moves: Sequence[Move], moved: Failed, split: Split) -> float:
        """Seconds of the state copies of a re-shape (see the module's copy model)."""
        job = self.job
        bandwidth = job.hw.network_bandwidth
        layout = job.layout_for(split)
        before = self.live(failed)
        after = self.live(moved)
        longest = 0.0
        joiners = [0] * job.stages
        for move in moves:
            joiners[move.target[1]] += 1
        for s, k in enumerate(joiners):
            if k:  # movers copy the whole (new) stage from the live replicas staying in it
                sources = max(1, before[s] - sum(1 for m in moves if m.source[1] == s))
                longest = max(longest, math.ceil(k / sources) * layout.stage_state_bytes[s] / bandwidth)
        if split != layers:
            old = _ranges(layers)
            for s, (start, end) in enumerate(_ranges(split)):
                gained = sum(1 for layer in range(start, end) if not old[s][0] <= layer < old[s][1])
                if not gained:
                    continue
                holders = [t for t, (a, b) in enumerate(old) if t != s and a < end and start < b]
                sources = max(1, min(after[t] for t in holders))
                receivers = after[s] - joiners[s]
                rounds = math.ceil(receivers / sources)
                longest = max(longest, rounds * gained * layout.layer_state_bytes / bandwidth)
        return longest


def _ranges(layers: Split) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in layers:
        out.append((start, start + n))
        start += n
    return out
