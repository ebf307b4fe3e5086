"""Greedy list scheduling of F, B, W and S ops for a given micro-batch assignment.

The assignment says which pipeline's worker at stage ``s`` runs micro-batch ``(h, k)``; without
failures every micro-batch runs in its home pipeline. The scheduler then decides the order and
times on every worker with the priorities of a ZB-H1-like schedule:

1. BackwardInput first (it is on the critical path), oldest forward first;
2. then Forward, while the worker holds fewer than ``warmup_limit`` micro-batches between F and B
   (``P - s`` in 1F1B) and fewer than ``memory_cap`` between F and W;
3. then BackwardWeight, which therefore fills the bubbles.

S of a stage starts when every W of that stage, on all its live workers, has ended (staggered),
or when every W of every stage has ended (synchronous).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ds_recycle.planner.plan import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    STEP,
    CostModel,
    Op,
    Worker,
)

Assignment = Mapping[tuple[int, int, int], int]
"""``(home, mb, stage) -> pipeline`` whose worker at ``stage`` runs that micro-batch."""


@dataclass(frozen=True)
class ScheduleOptions:
    decoupled: bool = True
    """Split backward into B and a deferred W; if false, W runs right after its B."""
    staggered: bool = True
    """Each stage steps when its own W are done; if false, all stages step together."""


def identity_assignment(pipelines: int, stages: int, microbatches: int) -> dict[tuple[int, int, int], int]:
    return {(h, k, s): h for h in range(pipelines) for k in range(microbatches) for s in range(stages)}


def one_f_one_b_limit(stages: int) -> Callable[[Worker], int]:
    """1F1B's bound on micro-batches between F and B at each stage: ``P - s``."""
    return lambda worker: stages - worker[1]


def list_schedule(
    pipelines: int,
    stages: int,
    microbatches: int,
    assignment: Assignment,
    costs: CostModel,
    memory_cap: int,
    options: ScheduleOptions = ScheduleOptions(),
    warmup_limit: Callable[[Worker], int] | None = None,
) -> dict[Worker, list[Op]]:
    """Return every live worker's ordered, timed ops. Raises ValueError if the assignment
    leaves some op unschedulable (for example a memory cap below 1)."""
    if memory_cap < 1:
        raise ValueError(f"memory_cap={memory_cap}: a worker must be able to hold at least 1 micro-batch")
    limit = warmup_limit or one_f_one_b_limit(stages)
    state = _SchedulerState(pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit)
    return state.run()


class _SchedulerState:
    def __init__(self, pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit):
        self.P = stages
        self.costs = costs
        self.memory_cap = memory_cap
        self.options = options
        self.assignment = assignment
        self.workers: list[Worker] = sorted({(p, s) for (_h, _k, s), p in assignment.items()})
        self.limit = {w: max(1, limit(w)) for w in self.workers}
        self.mbs_of: dict[Worker, list[tuple[int, int]]] = {w: [] for w in self.workers}
        for (h, k, s), p in sorted(assignment.items(), key=lambda item: (item[0][1], item[0][0])):
            self.mbs_of[(p, s)].append((h, k))
        expected = pipelines * microbatches * stages
        if len(assignment) != expected:
            raise ValueError(f"assignment covers {len(assignment)} of {expected} (home, mb, stage) triples")
        self.end: dict[tuple[str, int, int, int], float] = {}
        self.ops: dict[Worker, list[Op]] = {w: [] for w in self.workers}
        self.free_at = {w: 0.0 for w in self.workers}
        self.pending_f = {w: list(self.mbs_of[w]) for w in self.workers}
        self.awaiting_b: dict[Worker, list[tuple[int, int]]] = {w: [] for w in self.workers}
        self.awaiting_w: dict[Worker, list[tuple[int, int]]] = {w: [] for w in self.workers}
        self.count = {w: {FORWARD: 0, BACKWARD_INPUT: 0, BACKWARD_WEIGHT: 0} for w in self.workers}

    def run(self) -> dict[Worker, list[Op]]:
        total = sum(len(v) for v in self.mbs_of.values()) * 3
        scheduled = 0
        while scheduled < total:
            choice = None
            for w in self.workers:
                candidate = self._next_op(w)
                if candidate is not None and (choice is None or candidate[0] < choice[0]):
                    choice = (candidate[0], w, candidate[1], candidate[2], candidate[3])
            if choice is None:
                raise ValueError("list scheduler: no op can start (cyclic dependencies or memory cap too small)")
            start, w, kind, h, k = choice
            scheduled += self._place(w, kind, h, k, start)
            if kind == BACKWARD_INPUT and not self.options.decoupled:
                scheduled += self._place(w, BACKWARD_WEIGHT, h, k, self.free_at[w])
        self._place_steps()
        return self.ops

    def _runner(self, h: int, k: int, s: int) -> Worker:
        return (self.assignment[(h, k, s)], s)

    def _arrival(self, kind: str, h: int, k: int, s: int, consumer: Worker) -> float | None:
        """When the output of op ``kind`` of (h, k, s) is usable on ``consumer``; None if not yet scheduled."""
        if kind == BACKWARD_INPUT and not self.options.decoupled:
            kind = BACKWARD_WEIGHT  # a fused backward sends its input grads only when it is done
        end = self.end.get((kind, h, k, s))
        if end is None:
            return None
        return end + (self.costs.comm if self._runner(h, k, s) != consumer else 0.0)

    def _ready(self, w: Worker, kind: str, h: int, k: int) -> float | None:
        s = w[1]
        if kind == FORWARD:
            return 0.0 if s == 0 else self._arrival(FORWARD, h, k, s - 1, w)
        if kind == BACKWARD_INPUT:
            own_f = self.end.get((FORWARD, h, k, s))
            if own_f is None:
                return None
            if s == self.P - 1:
                return own_f
            upstream = self._arrival(BACKWARD_INPUT, h, k, s + 1, w)
            return None if upstream is None else max(own_f, upstream)
        return self.end.get((BACKWARD_INPUT, h, k, s))

    def _next_op(self, w: Worker):
        """(start, kind, h, k) of the op the worker runs next, by priority, or None."""
        now = self.free_at[w]
        counts = self.count[w]
        f_allowed = (
            counts[FORWARD] - counts[BACKWARD_INPUT] < self.limit[w]
            and counts[FORWARD] - counts[BACKWARD_WEIGHT] < self.memory_cap
        )
        queues = [(BACKWARD_INPUT, self.awaiting_b[w])]
        if f_allowed:
            queues.append((FORWARD, self.pending_f[w]))
        if self.options.decoupled:
            queues.append((BACKWARD_WEIGHT, self.awaiting_w[w]))
        earliest = None
        for kind, queue in queues:
            for h, k in queue:
                ready = self._ready(w, kind, h, k)
                if ready is None:
                    continue
                if ready <= now:
                    return (now, kind, h, k)
                if earliest is None or ready < earliest[0]:
                    earliest = (ready, kind, h, k)
        return earliest

    def _place(self, w: Worker, kind: str, h: int, k: int, start: float) -> int:
        duration = self.costs.duration(kind, w[1])
        op = Op(kind, h, k, w[1], start, start + duration)
        self.ops[w].append(op)
        self.end[(kind, h, k, w[1])] = op.end
        self.free_at[w] = op.end
        self.count[w][kind] += 1
        if kind == FORWARD:
            self.pending_f[w].remove((h, k))
            self.awaiting_b[w].append((h, k))
        elif kind == BACKWARD_INPUT:
            self.awaiting_b[w].remove((h, k))
            self.awaiting_w[w].append((h, k))
        else:
            self.awaiting_w[w].remove((h, k))
        return 1

    def _place_steps(self) -> None:
        last_w = {}
        for p, s in self.workers:
            last_w[s] = max(last_w.get(s, 0.0), self.free_at[(p, s)])
        everything_done = max(last_w.values(), default=0.0)
        for w in self.workers:
            start = last_w[w[1]] if self.options.staggered else everything_done
            self.ops[w].append(Op(STEP, -1, -1, w[1], start, start + self.costs.step))
