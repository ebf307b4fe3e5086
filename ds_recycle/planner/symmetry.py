"""Untouched pipelines: plan the pipelines a failure set touches, plus one that stands for the rest.

A pipeline is touched when it has a failed worker, or when one of its micro-batches runs on another
pipeline's worker or another pipeline's micro-batch runs on one of its workers (re-routing). Every
other pipeline runs its own micro-batches on its own workers and exchanges nothing with any other
pipeline, and the list scheduler and the plan simulator treat all of them alike: each gets the ops
of any one of them (the representative) with the pipeline renamed, and the step of a stage, which
waits for the stage's latest W, sees the same W on all of them. So the planner schedules and
simulates a reduced problem of the touched pipelines plus the representative, and copies the
representative's ops for the other untouched pipelines (:meth:`Reduction.expand`). At D = 128 with
two failures and m = 32 that is 34 pipelines instead of 128.

The plan is the one the full problem gives, op for op and time for time: the list scheduler breaks
ties by pipeline label and by the order in which events were queued; the reduced problem keeps the
labels in their order (the representative is the lowest untouched label, and no untouched
pipeline's event ever reaches a kept one), so the kept pipelines see the same events in the same
order and take the same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from ds_recycle.planner.plan import Op, Worker

Moves = Mapping[tuple[int, int, int], int]
"""``(home, mb, stage) -> pipeline`` for the re-routed micro-batches only (runner != home)."""

_new_op = tuple.__new__


@dataclass(frozen=True)
class Reduction:
    """The reduced problem's pipelines: ``kept[i]`` is the full problem's label of reduced pipeline
    ``i`` (ascending); ``representative`` is the kept untouched pipeline, None when every pipeline
    is touched."""

    pipelines: int
    kept: tuple[int, ...]
    representative: int | None

    @classmethod
    def of(cls, pipelines: int, failed: Iterable[Worker], moves: Moves) -> Reduction:
        touched = {p for p, _s in failed}
        for (home, _mb, _stage), runner in moves.items():
            touched.add(home)
            touched.add(runner)
        representative = next((p for p in range(pipelines) if p not in touched), None)
        kept = touched if representative is None else touched | {representative}
        return cls(pipelines, tuple(sorted(kept)), representative)

    @classmethod
    def none(cls, pipelines: int) -> Reduction:
        """Keep every pipeline (for problems whose pipelines are not interchangeable)."""
        return cls(pipelines, tuple(range(pipelines)), None)

    @property
    def size(self) -> int:
        return len(self.kept)

    def index(self) -> dict[int, int]:
        """Full label -> reduced label, for the kept pipelines."""
        return {p: i for i, p in enumerate(self.kept)}

    def failed(self, failed: Iterable[Worker]) -> tuple[Worker, ...]:
        index = self.index()
        return tuple(sorted((index[p], s) for p, s in failed))

    def assignment(self, stages: int, microbatches: int, moves: Moves) -> dict[tuple[int, int, int], int]:
        """The reduced problem's full assignment: every kept pipeline's micro-batches at home,
        except the moves."""
        index = self.index()
        assignment = {(i, k, s): i for i in range(self.size) for k in range(microbatches) for s in range(stages)}
        for (home, mb, stage), runner in moves.items():
            assignment[(index[home], mb, stage)] = index[runner]
        return assignment

    def expand(self, workers: Mapping[Worker, list[Op]], stages: int, labels: Sequence[int]) -> dict[Worker, list[Op]]:
        """The full problem's workers from the reduced problem's ``workers``, with the full
        problem's pipeline ``q`` named ``labels[q]`` (its ops' homes too). Workers come in the
        order of the full problem's ``(pipeline, stage)``."""
        index = self.index()
        names = [labels[p] for p in self.kept] + [-1]  # names[-1]: a step's home stays -1
        columns = {}
        if self.representative is not None:
            r = index[self.representative]
            for s in range(stages):
                ops = workers.get((r, s))
                if ops is not None:
                    columns[s] = tuple(zip(*ops, strict=True)) if ops else ((),) * 6
        out: dict[Worker, list[Op]] = {}
        for q in range(self.pipelines):
            i = index.get(q)
            for s in range(stages):
                if i is not None:
                    ops = workers.get((i, s))
                    if ops is None:
                        continue
                    if not ops:
                        out[(labels[q], s)] = []
                        continue
                    kinds, homes, mbs, stage_col, starts, ends = zip(*ops, strict=True)
                    homes = [names[h] for h in homes]
                else:
                    kinds, homes, mbs, stage_col, starts, ends = columns[s]
                    name = labels[q]
                    homes = [name if h >= 0 else h for h in homes]
                out[(labels[q], s)] = list(
                    map(_new_op, repeat(Op, len(kinds)), zip(kinds, homes, mbs, stage_col, starts, ends, strict=True))
                )
        return out


__all__ = ["Moves", "Reduction"]
