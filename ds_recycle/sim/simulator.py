"""Replay a plan's per-worker op order under its cost model, over one or many iterations.

Every op starts as soon as its worker is free and its inputs are there (as soon as possible, in
the plan's order). Dependencies are those of DESIGN.md §3 with the p2p latency between different
workers; S of a stage starts when every live worker of the stage has reached its S (staggered), or
when every live worker has (synchronous). Iteration i+1 repeats the same order on every worker, so
F of iteration i+1 on a worker starts after that worker's S of iteration i: a stage that has
stepped starts the next iteration while later stages are still finishing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, STEP, Op, Plan, Worker


@dataclass
class SimResult:
    makespan: float
    """The end of the first iteration, started with every worker idle at time 0."""
    steady_state_period: float
    """Time between the ends of consecutive iterations once the transient has passed."""
    iteration_ends: list[float]
    busy: dict[Worker, float]
    """Compute time of each worker in one iteration (F+B+W+S)."""

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total else 0.0


def simulate(plan: Plan, iterations: int = 4, staggered: bool | None = None) -> SimResult:
    """Run ``iterations`` consecutive iterations of ``plan``. ``staggered`` defaults to the way the
    plan was made (``plan.extra["staggered"]``, True if absent)."""
    return retime_and_simulate(plan, iterations, staggered)[1]


def retime_and_simulate(plan: Plan, iterations: int = 4, staggered: bool | None = None) -> tuple[Plan, SimResult]:
    """:func:`retime` and :func:`simulate` from one replay."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    if staggered is None:
        staggered = plan.extra.get("staggered", True)
    timed = _replay(plan, iterations, staggered)
    ends = [0.0] * iterations
    for worker_ops in timed.values():
        for it, op in worker_ops:
            ends[it] = max(ends[it], op.end)
    if iterations == 1:
        period = ends[0]
    else:
        half = (iterations - 1) // 2
        period = (ends[-1] - ends[half]) / (iterations - 1 - half)
    busy = {w: sum(op.end - op.start for op in ops) for w, ops in plan.workers.items()}
    workers = {w: [op for it, op in ops if it == 0] for w, ops in timed.items()}
    return replace(plan, workers=workers, iteration_time=ends[0]), SimResult(ends[0], period, ends, busy)


def retime(plan: Plan, staggered: bool | None = None) -> Plan:
    """The same plan with every op moved to its earliest start in the plan's order; the
    iteration time becomes the new makespan. Never later than the plan's own times."""
    if staggered is None:
        staggered = plan.extra.get("staggered", True)
    timed = _replay(plan, 1, staggered)
    workers = {w: [op for _it, op in ops] for w, ops in timed.items()}
    makespan = max((op.end for ops in workers.values() for op in ops), default=0.0)
    return replace(plan, workers=workers, iteration_time=makespan)


def _replay(plan: Plan, iterations: int, staggered: bool) -> dict[Worker, list[tuple[int, Op]]]:
    costs = plan.costs
    comm = costs.comm
    last = plan.stages - 1
    workers = plan.live_workers
    orders = [plan.workers[w] for w in workers]
    n_ops = [len(ops) for ops in orders]
    runner = {}
    for i, ops in enumerate(orders):
        for op in ops:
            if op.kind != STEP:
                runner[(op.kind, op.home, op.mb, op.stage)] = i
    group_of = [w[1] if staggered else 0 for w in workers]
    group_size: dict[int, int] = {}
    for g in group_of:
        group_size[g] = group_size.get(g, 0) + 1

    end: dict[tuple, float] = {}
    waiting: dict[tuple, list[int]] = {}
    at_step: dict[tuple[int, int], list[int]] = {}
    free = [0.0] * len(workers)
    pc = [0] * len(workers)  # index into the K concatenated copies of the worker's ops
    out: list[list[tuple[int, Op]]] = [[] for _ in workers]
    stack = list(range(len(workers)))
    total = iterations * sum(n_ops)
    done = 0

    def finish(i: int, it: int, op: Op, start: float) -> None:
        nonlocal done
        duration = costs.duration(op.kind, op.stage)
        stop = start + duration
        out[i].append((it, Op(op.kind, op.home, op.mb, op.stage, start, stop)))
        free[i] = stop
        pc[i] += 1
        done += 1
        if op.kind != STEP:
            key = (it, op.kind, op.home, op.mb, op.stage)
            end[key] = stop
            for waiter in waiting.pop(key, ()):
                stack.append(waiter)

    while stack:
        i = stack.pop()
        ops = orders[i]
        while pc[i] < iterations * n_ops[i]:
            it, j = divmod(pc[i], n_ops[i])
            op = ops[j]
            kind, h, k, s = op.kind, op.home, op.mb, op.stage
            if kind == STEP:
                group = (it, group_of[i])
                arrived = at_step.setdefault(group, [])
                if i in arrived:
                    break
                arrived.append(i)
                if len(arrived) < group_size[group_of[i]]:
                    break
                start = max(free[p] for p in arrived)
                for p in arrived:
                    finish(p, it, orders[p][pc[p] % n_ops[p]], start)
                    if p != i:
                        stack.append(p)
                continue
            deps = []
            if kind == FORWARD and s > 0:
                deps.append((it, FORWARD, h, k, s - 1))
            elif kind == BACKWARD_INPUT:
                deps.append((it, FORWARD, h, k, s))
                if s < last:
                    deps.append((it, BACKWARD_INPUT, h, k, s + 1))
            elif kind == BACKWARD_WEIGHT:
                deps.append((it, BACKWARD_INPUT, h, k, s))
            start = free[i]
            blocked = None
            for dep in deps:
                t = end.get(dep)
                if t is None:
                    blocked = dep
                    break
                if runner[dep[1:]] != i:
                    t += comm
                start = max(start, t)
            if blocked is not None:
                waiting.setdefault(blocked, []).append(i)
                break
            finish(i, it, op, start)
    if done != total:
        stuck = [workers[i] for i in range(len(workers)) if pc[i] < iterations * n_ops[i]]
        raise ValueError(f"simulator: the plan's op order deadlocks (stuck workers: {stuck})")
    return {w: out[i] for i, w in enumerate(workers)}


__all__ = ["SimResult", "retime", "retime_and_simulate", "simulate"]
