"""Failure normalization: failure sets equal up to a relabelling of pipelines share one key.

Pipelines are interchangeable (each holds a full replica of the model), so a failure set is
characterised by the multiset of per-pipeline failed-stage tuples. The canonical labelling sorts
pipelines by their failed stages (pipelines with failures first, then by the tuple of failed
stages, ties by original label), and a plan made for the canonical set is mapped back to the
original labels by renaming the pipeline of every worker and the ``home`` of every op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from ds_recycle.planner.plan import STEP, Op, Plan, Worker

CanonicalKey = tuple[Worker, ...]


def canonical(pipelines: int, stages: int, failed: Iterable[Worker]) -> tuple[CanonicalKey, list[int]]:
    """Return ``(key, permutation)``: ``key`` is the canonical failure set (sorted ``(p, s)``
    tuples), and ``permutation[original_pipeline] = canonical_pipeline``."""
    by_pipeline: dict[int, set[int]] = {p: set() for p in range(pipelines)}
    for p, s in failed:
        if not (0 <= p < pipelines and 0 <= s < stages):
            raise ValueError(f"failed worker ({p}, {s}) is outside the grid of {pipelines} pipelines x {stages} stages")
        by_pipeline[p].add(s)
    order = sorted(range(pipelines), key=lambda p: (not by_pipeline[p], tuple(sorted(by_pipeline[p])), p))
    permutation = [0] * pipelines
    for canonical_p, original_p in enumerate(order):
        permutation[original_p] = canonical_p
    key = tuple(sorted((permutation[p], s) for p, stages_ in by_pipeline.items() for s in stages_))
    return key, permutation


def invert(permutation: Sequence[int]) -> list[int]:
    inverse = [0] * len(permutation)
    for original, image in enumerate(permutation):
        inverse[image] = original
    return inverse


def relabel(plan: Plan, mapping: Sequence[int]) -> Plan:
    """Rename pipeline ``p`` to ``mapping[p]`` everywhere in the plan (workers, homes, failures).
    To map a plan for the canonical set back: ``relabel(plan, invert(permutation))``."""
    if sorted(mapping) != list(range(plan.pipelines)):
        raise ValueError(f"relabel: {list(mapping)} is not a permutation of range({plan.pipelines})")
    workers: dict[Worker, list[Op]] = {}
    for (p, s), ops in plan.workers.items():
        workers[(mapping[p], s)] = [
            Op(kind, home if kind == STEP else mapping[home], mb, stage, start, end)
            for kind, home, mb, stage, start, end in ops
        ]
    failed = tuple(sorted((mapping[p], s) for p, s in plan.failed))
    return replace(plan, failed=failed, workers=workers, extra=dict(plan.extra))
