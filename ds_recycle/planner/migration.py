"""Which survivor moves into which dead slot when failures have unbalanced the grid.

ReCycle's iteration follows its slowest stage, and a stage's time is its work divided among its
live workers: a stage that has lost ``k`` of its ``D`` workers makes every other stage wait. A
*migration* moves a survivor of a stage with workers to spare into a dead slot of a stage short of
them: the mover leaves its slot and re-joins the other through the join path, copying that stage's
state from a live replica. The failure set changes; the live workers, the global batch and the
math do not.

The simulator (``sim/rebalance.py``) and the runtime (``runtime/rank/recovery.py``) choose moves with
the same rule, :func:`next_move`; the runtime takes one move at a time (each is a leave and a join)
and only into slots that will not be respawned, and both keep a move only if the planner predicts
that it pays.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ds_recycle.planner.plan import Worker


@dataclass(frozen=True)
class Move:
    """A survivor leaves ``source`` and re-joins the dead slot ``target`` (both ``(pipeline, stage)``)."""

    source: Worker
    target: Worker


def live_per_stage(pipelines: int, stages: int, failed: Collection[Worker]) -> list[int]:
    """Live workers per stage."""
    counts = [pipelines] * stages
    for _p, s in failed:
        counts[s] -= 1
    return counts


def needed(pipelines: int, live: Sequence[int], work: Sequence[float]) -> list[int]:
    """The fewest workers per stage that reach the best balance ``min max work_s / n_s`` for
    ``sum(live)`` workers, at most ``pipelines`` per stage (the stages short of them get movers)."""
    total = sum(live)
    counts = [1] * len(live)
    for _ in range(total - len(live)):
        open_ = [s for s in range(len(live)) if counts[s] < pipelines]
        s = max(open_, key=lambda s: (work[s] / counts[s], -s))
        counts[s] += 1
    bottleneck = max(w / n for w, n in zip(work, counts, strict=True))
    return [max(1, math.ceil(w / bottleneck - 1e-9)) for w in work]


def next_move(
    pipelines: int,
    stages: int,
    dead: Collection[Worker],
    want: Sequence[int],
    work: Sequence[float],
    targets: Collection[Worker] | None = None,
    sources: Collection[Worker] | None = None,
) -> Move | None:
    """The next move towards ``want`` live workers per stage, or None: a survivor of the stage
    with the most workers to spare goes into a dead slot of the stage furthest below its need. The
    mover leaves the pipeline with the most dead slots and joins the one with the fewest, so dead
    slots gather in few pipelines (ties: the lowest index). ``targets`` limits the dead slots that
    may be filled and ``sources`` the survivors that may move (None: any)."""
    dead = set(dead)
    live = live_per_stage(pipelines, stages, dead)
    allowed = dead if targets is None else dead & set(targets)
    short = [s for s in range(stages) if live[s] < want[s] and any(w[1] == s for w in allowed)]
    spare = [s for s in range(stages) if live[s] > want[s]]
    if not short or not spare:
        return None
    b = min(short, key=lambda s: (live[s] / work[s], s))
    per_pipeline = [sum(1 for p, _s in dead if p == q) for q in range(pipelines)]
    for a in sorted(spare, key=lambda s: (-(live[s] - want[s]), live[s] / work[s], s)):
        movers = [(p, a) for p in range(pipelines) if (p, a) not in dead]
        if sources is not None:
            movers = [w for w in movers if w in sources]
        if movers:
            source = max(movers, key=lambda w: (per_pipeline[w[0]], -w[0]))
            slot = min((w for w in allowed if w[1] == b), key=lambda w: (per_pipeline[w[0]], w[0]))
            return Move(source, slot)
    return None


def migrate(
    pipelines: int, stages: int, failed: Collection[Worker], work: Sequence[float], want: Sequence[int] | None = None
) -> tuple[tuple[Move, ...], tuple[Worker, ...]]:
    """The fewest moves that give each stage at least its ``want`` live workers (default:
    :func:`needed`), and the failure set after them (:func:`next_move`, repeated)."""
    dead = set(failed)
    if want is None:
        want = needed(pipelines, live_per_stage(pipelines, stages, dead), work)
    moves: list[Move] = []
    while (move := next_move(pipelines, stages, dead, want, work)) is not None:
        dead.discard(move.target)
        dead.add(move.source)
        moves.append(move)
    return tuple(moves), tuple(sorted(dead))
