"""Replay a plan's per-worker op order under its cost model, over one or many iterations.

Every op starts as soon as its worker is free and its inputs are there (as soon as possible, in
the plan's order). Dependencies are those of docs/design.md §4 with the p2p latency between different
workers. With a fused backward (``decoupled`` false) the input gradient leaves a worker only when
its whole backward is done, so B of stage s waits for W of stage s+1. S of a stage starts when
every live worker of the stage has reached its S (staggered), or when every live worker has
(synchronous). Both options default to the way the plan was made (``plan.extra``).

Iteration i+1 repeats the same order on every worker, so F of iteration i+1 on a worker starts
after that worker's S of iteration i: a stage that has stepped starts the next iteration while
later stages are still finishing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import repeat

from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, STEP, Op, Plan, Worker


@dataclass
class SimResult:
    makespan: float
    """The end of the first iteration, started with every worker idle at time 0."""
    steady_state_period: float
    """Time between the ends of consecutive iterations once the transient has passed."""
    iteration_ends: list[float]


def simulate(
    plan: Plan, iterations: int = 4, staggered: bool | None = None, decoupled: bool | None = None
) -> SimResult:
    """Run ``iterations`` consecutive iterations of ``plan``."""
    return retime_and_simulate(plan, iterations, staggered, decoupled)[1]


def retime_and_simulate(
    plan: Plan,
    iterations: int = 4,
    staggered: bool | None = None,
    decoupled: bool | None = None,
    precedences: Precedences | None = None,
) -> tuple[Plan, SimResult]:
    """:func:`retime` and :func:`simulate` from one replay. ``precedences``: the plan's graph as
    the list scheduler that made it recorded it (``list_schedule_with_precedences``), which spares
    building it and replaying the first iteration worker by worker; ignored unless it was
    recorded for these ``staggered`` and ``decoupled``."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    if staggered is None:
        staggered = plan.extra.get("staggered", True)
    if decoupled is None:
        decoupled = plan.extra.get("decoupled", True)
    if precedences is not None and (precedences.staggered, precedences.decoupled) != (staggered, decoupled):
        precedences = None
    workers, ends = _replay(plan, iterations, staggered, decoupled, precedences)
    if iterations == 1:
        period = ends[0]
    else:
        half = (iterations - 1) // 2
        period = (ends[-1] - ends[half]) / (iterations - 1 - half)
    return replace(plan, workers=workers, iteration_time=ends[0]), SimResult(ends[0], period, ends)


def retime(plan: Plan, staggered: bool | None = None, decoupled: bool | None = None) -> Plan:
    """The same plan with every op moved to its earliest start in the plan's order; the
    iteration time becomes the new makespan. Never later than the plan's own times. Raises
    ValueError if the order contradicts the precedences (the replay deadlocks)."""
    return retime_and_simulate(plan, 1, staggered, decoupled)[0]


def _replay(
    plan: Plan, iterations: int, staggered: bool, decoupled: bool, precedences: Precedences | None = None
) -> tuple[dict[Worker, list[Op]], list[float]]:
    """ASAP times of the plan's order over ``iterations`` iterations: the first iteration's
    timed ops and the end of every iteration.

    An op depends only on ops of its own iteration and on its worker's previous op, so iteration
    i+1 is iteration i's graph again, started from each worker's end of iteration i. The first
    iteration is replayed worker by worker (which finds a deadlock); the order in which its ops
    got their times is a topological order of that graph, and the later iterations walk it.
    With ``precedences`` the graph and such an order come from the list scheduler."""
    if precedences is None:
        graph = _Graph(plan, staggered, decoupled)
        start, end, order = graph.first_iteration()
    else:
        graph = _Graph.recorded(plan, precedences)
        order = precedences.order
        start, end = [0.0] * len(order), [0.0] * len(order)
        graph.walk(order, [0.0] * len(graph.workers), end, start)
    ends = [max(end, default=0.0)]
    if iterations > 1:
        last = [ids[-1] if ids else -1 for ids in graph.ids]
        free = [end[i] if i >= 0 else 0.0 for i in last]
        later_end = list(end)
        for _ in range(1, iterations):
            graph.walk(order, free, later_end)
            ends.append(max(later_end, default=0.0))
    timed = {}
    for w, ops, first in zip(graph.workers, graph.orders, graph.first, strict=True):
        if not ops:
            timed[w] = []
            continue
        kinds, homes, mbs, stages, _starts, _ends = zip(*ops, strict=True)
        stop = first + len(ops)
        columns = zip(kinds, homes, mbs, stages, start[first:stop], end[first:stop], strict=True)
        timed[w] = list(map(_new_op, repeat(Op, len(ops)), columns))
    return timed, ends


_new_op = tuple.__new__


@dataclass
class Precedences:
    """A plan's precedence graph as :class:`_Graph` numbers it (worker by worker, in the order of
    ``plan.live_workers``, each worker's ops in its order): every op's worker index, duration, at
    most two predecessors with their p2p lag (-1: none) and, for an S, its step group (-1: not an
    S); ``order`` lists every op after its predecessors; recorded for ``staggered`` and
    ``decoupled``."""

    staggered: bool
    decoupled: bool
    where: list[int]
    duration: list[float]
    dep_a: list[int]
    lag_a: list[float]
    dep_b: list[int]
    lag_b: list[float]
    group: list[int]
    order: list[int]


class _Graph:
    """A plan's ops numbered worker by worker, each with its duration, its at most two
    precedences (op and p2p lag; -1 for none) and, for an S, its step group."""

    @classmethod
    def recorded(cls, plan: Plan, precedences: Precedences) -> _Graph:
        """The graph of ``plan`` from its recorded ``precedences``."""
        graph = cls.__new__(cls)
        graph.workers = plan.live_workers
        graph.orders = [plan.workers[w] for w in graph.workers]
        graph.first, graph.ids = [], []
        first = 0
        for ops in graph.orders:
            graph.first.append(first)
            graph.ids.append(list(range(first, first + len(ops))))
            first += len(ops)
        if first != len(precedences.where):
            raise ValueError(f"simulator: the precedences hold {len(precedences.where)} ops, the plan {first}")
        p = precedences
        graph.where, graph.duration, graph.group = p.where, p.duration, p.group
        graph.dep_a, graph.lag_a, graph.dep_b, graph.lag_b = p.dep_a, p.lag_a, p.dep_b, p.lag_b
        graph.members = {}
        for wi, worker in enumerate(graph.workers):
            graph.members.setdefault(worker[1] if p.staggered else 0, []).append(wi)
        return graph

    def __init__(self, plan: Plan, staggered: bool, decoupled: bool) -> None:
        costs = plan.costs
        comm = costs.comm
        last = plan.stages - 1
        self.workers = workers = plan.live_workers
        self.orders = orders = [plan.workers[w] for w in workers]
        ids_of: dict[str, dict[tuple[int, int, int], int]] = {FORWARD: {}, BACKWARD_INPUT: {}, BACKWARD_WEIGHT: {}}
        where: list[int] = []
        duration: list[float] = []
        self.ids = ids = []
        self.first = []
        for wi, ops in enumerate(orders):
            first = len(where)
            self.first.append(first)
            ids.append(list(range(first, first + len(ops))))
            worker = workers[wi]
            durations = {kind: costs.op_duration(kind, worker) for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
            durations[STEP] = costs.step
            for i, (kind, h, k, s, _start, _end) in enumerate(ops, first):
                if kind != STEP:
                    ids_of[kind][(h, k, s)] = i
                duration.append(durations[kind])
            where.extend([wi] * len(ops))
        n = len(where)
        self.where, self.duration = where, duration
        dep_a, lag_a, dep_b, lag_b = [-1] * n, [0.0] * n, [-1] * n, [0.0] * n
        group = [-1] * n
        group_of = [w[1] if staggered else 0 for w in workers]
        f_id, b_id = ids_of[FORWARD], ids_of[BACKWARD_INPUT]
        after_id = b_id if decoupled else ids_of[BACKWARD_WEIGHT]
        after_b = BACKWARD_INPUT if decoupled else BACKWARD_WEIGHT

        def find(table: dict, kind: str, key: tuple[int, int, int], op: Op) -> int:
            d = table.get(key)
            if d is None:
                raise ValueError(f"simulator: {op.label()} depends on {(kind, *key)}, which no worker runs")
            return d

        i = 0
        for ops in orders:
            for op in ops:
                kind, h, k, s = op[0], op[1], op[2], op[3]
                w = where[i]
                if kind == FORWARD:
                    if s > 0:
                        d = f_id.get((h, k, s - 1))
                        if d is None:
                            d = find(f_id, FORWARD, (h, k, s - 1), op)
                        dep_a[i], lag_a[i] = d, comm if where[d] != w else 0.0
                elif kind == BACKWARD_INPUT:
                    d = f_id.get((h, k, s))
                    if d is None:
                        d = find(f_id, FORWARD, (h, k, s), op)
                    dep_a[i], lag_a[i] = d, comm if where[d] != w else 0.0
                    if s < last:
                        d = after_id.get((h, k, s + 1))
                        if d is None:
                            d = find(after_id, after_b, (h, k, s + 1), op)
                        dep_b[i], lag_b[i] = d, comm if where[d] != w else 0.0
                elif kind == BACKWARD_WEIGHT:
                    d = b_id.get((h, k, s))
                    if d is None:
                        d = find(b_id, BACKWARD_INPUT, (h, k, s), op)
                    dep_a[i], lag_a[i] = d, comm if where[d] != w else 0.0
                elif kind == STEP:
                    group[i] = group_of[w]
                i += 1
        self.dep_a, self.lag_a, self.dep_b, self.lag_b, self.group = dep_a, lag_a, dep_b, lag_b, group
        self.members: dict[int, list[int]] = {}
        for wi, g in enumerate(group_of):
            self.members.setdefault(g, []).append(wi)

    def first_iteration(self) -> tuple[list[float], list[float | None], list[int]]:
        """Start and end of every op, and the order in which they got them. Raises ValueError
        if the order deadlocks."""
        ids, where, duration, group = self.ids, self.where, self.duration, self.group
        deps = [
            () if a < 0 else ((a, la),) if b < 0 else ((a, la), (b, lb))
            for a, la, b, lb in zip(self.dep_a, self.lag_a, self.dep_b, self.lag_b, strict=True)
        ]
        n = len(where)
        n_workers = len(ids)
        group_size = {g: len(members) for g, members in self.members.items()}
        start: list[float] = [0.0] * n
        end: list[float | None] = [None] * n
        order: list[int] = []
        waiting: dict[int, list[int]] = {}
        at_step: dict[int, list[int]] = {}
        free = [0.0] * n_workers
        pc = [0] * n_workers
        lengths = [len(worker_ids) for worker_ids in ids]
        stack = list(range(n_workers))

        def finish(wi: int, i: int, at: float) -> None:
            stop = at + duration[i]
            start[i] = at
            end[i] = stop
            free[wi] = stop
            pc[wi] += 1
            order.append(i)
            waiters = waiting.pop(i, None)
            if waiters:
                stack.extend(waiters)

        while stack:
            wi = stack.pop()
            worker_ids = ids[wi]
            while pc[wi] < lengths[wi]:
                i = worker_ids[pc[wi]]
                g = group[i]
                if g >= 0:  # S: wait for the whole step group
                    arrived = at_step.setdefault(g, [])
                    if wi in arrived:
                        break
                    arrived.append(wi)
                    if len(arrived) < group_size[g]:
                        break
                    at = max(free[p] for p in arrived)
                    for p in arrived:
                        finish(p, ids[p][pc[p]], at)
                        if p != wi:
                            stack.append(p)
                    continue
                at = free[wi]
                blocked = -1
                for d, lag in deps[i]:
                    t = end[d]
                    if t is None:
                        blocked = d
                        break
                    if t + lag > at:
                        at = t + lag
                if blocked >= 0:
                    waiting.setdefault(blocked, []).append(wi)
                    break
                finish(wi, i, at)
        if len(order) != n:
            stuck = [self.workers[w] for w in range(n_workers) if pc[w] < lengths[w]]
            raise ValueError(f"simulator: the plan's op order deadlocks (stuck workers: {stuck})")
        return start, end, order

    def walk(self, order: list[int], free: list[float], end: list[float], start: list[float] | None = None) -> None:
        """One more iteration: every worker starts at ``free`` (updated to its new end); ``end``
        (and ``start``, if given) gets every op's end (start)."""
        where, duration, group, members = self.where, self.duration, self.group, self.members
        dep_a, lag_a, dep_b, lag_b = self.dep_a, self.lag_a, self.dep_b, self.lag_b
        step_start: dict[int, float] = {}
        for i in order:
            g = group[i]
            if g >= 0:
                t = step_start.get(g)
                if t is None:
                    t = step_start[g] = max(free[p] for p in members[g])
            else:
                t = free[where[i]]
                d = dep_a[i]
                if d >= 0:
                    x = end[d] + lag_a[i]
                    if x > t:
                        t = x
                    d = dep_b[i]
                    if d >= 0:
                        x = end[d] + lag_b[i]
                        if x > t:
                            t = x
            if start is not None:
                start[i] = t
            t += duration[i]
            end[i] = t
            free[where[i]] = t


__all__ = ["Precedences", "SimResult", "retime", "retime_and_simulate", "simulate"]
