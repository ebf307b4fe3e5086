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


def simulate(
    plan: Plan, iterations: int = 4, staggered: bool | None = None, decoupled: bool | None = None
) -> SimResult:
    """Run ``iterations`` consecutive iterations of ``plan``."""
    return retime_and_simulate(plan, iterations, staggered, decoupled)[1]


def retime_and_simulate(
    plan: Plan, iterations: int = 4, staggered: bool | None = None, decoupled: bool | None = None
) -> tuple[Plan, SimResult]:
    """:func:`retime` and :func:`simulate` from one replay."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    if staggered is None:
        staggered = plan.extra.get("staggered", True)
    if decoupled is None:
        decoupled = plan.extra.get("decoupled", True)
    workers, ends = _replay(plan, iterations, staggered, decoupled)
    if iterations == 1:
        period = ends[0]
    else:
        half = (iterations - 1) // 2
        period = (ends[-1] - ends[half]) / (iterations - 1 - half)
    busy = {w: sum(op.end - op.start for op in ops) for w, ops in plan.workers.items()}
    return replace(plan, workers=workers, iteration_time=ends[0]), SimResult(ends[0], period, ends, busy)


def retime(plan: Plan, staggered: bool | None = None, decoupled: bool | None = None) -> Plan:
    """The same plan with every op moved to its earliest start in the plan's order; the
    iteration time becomes the new makespan. Never later than the plan's own times. Raises
    ValueError if the order contradicts the precedences (the replay deadlocks)."""
    return retime_and_simulate(plan, 1, staggered, decoupled)[0]


def _replay(
    plan: Plan, iterations: int, staggered: bool, decoupled: bool
) -> tuple[dict[Worker, list[Op]], list[float]]:
    """ASAP times of the plan's order over ``iterations`` iterations: the first iteration's
    timed ops and the end of every iteration."""
    costs = plan.costs
    comm = costs.comm
    last = plan.stages - 1
    workers = plan.live_workers
    n_workers = len(workers)
    orders = [plan.workers[w] for w in workers]
    # number every op; deps[i] = [(op id, lag)], S ops get dep None and a step group
    op_id: dict[tuple[str, int, int, int], int] = {}
    where: list[int] = []
    flat: list[Op] = []
    for wi, ops in enumerate(orders):
        for op in ops:
            if op.kind != STEP:
                op_id[(op.kind, op.home, op.mb, op.stage)] = len(flat)
            where.append(wi)
            flat.append(op)
    ids = [[0] * len(ops) for ops in orders]
    i = 0
    for wi, ops in enumerate(orders):
        for j in range(len(ops)):
            ids[wi][j] = i
            i += 1
    n = len(flat)
    duration = [costs.op_duration(op.kind, workers[wi]) for op, wi in zip(flat, where, strict=True)]
    deps: list[list[tuple[int, float]] | None] = []
    for i, op in enumerate(flat):
        kind, h, k, s = op.kind, op.home, op.mb, op.stage
        if kind == STEP:
            deps.append(None)
            continue
        keys = []
        if kind == FORWARD and s > 0:
            keys.append((FORWARD, h, k, s - 1))
        elif kind == BACKWARD_INPUT:
            keys.append((FORWARD, h, k, s))
            if s < last:
                keys.append((BACKWARD_INPUT if decoupled else BACKWARD_WEIGHT, h, k, s + 1))
        elif kind == BACKWARD_WEIGHT:
            keys.append((BACKWARD_INPUT, h, k, s))
        out = []
        for key in keys:
            d = op_id.get(key)
            if d is None:
                raise ValueError(f"simulator: {op.label()} depends on {key}, which no worker runs")
            out.append((d, comm if where[d] != where[i] else 0.0))
        deps.append(out)
    group_of = [w[1] if staggered else 0 for w in workers]
    group_size: dict[int, int] = {}
    for g in group_of:
        group_size[g] = group_size.get(g, 0) + 1

    start_t = [[0.0] * n for _ in range(iterations)]
    end_t: list[list[float | None]] = [[None] * n for _ in range(iterations)]
    waiting: dict[tuple[int, int], list[int]] = {}
    at_step: dict[tuple[int, int], list[int]] = {}
    free = [0.0] * n_workers
    pc = [0] * n_workers  # position in the K concatenated copies of the worker's ops
    lengths = [len(ops) for ops in orders]
    stack = list(range(n_workers))
    done = 0

    def finish(wi: int, it: int, i: int, start: float) -> None:
        nonlocal done
        stop = start + duration[i]
        start_t[it][i] = start
        end_t[it][i] = stop
        free[wi] = stop
        pc[wi] += 1
        done += 1
        waiters = waiting.pop((it, i), None)
        if waiters:
            stack.extend(waiters)

    while stack:
        wi = stack.pop()
        length = lengths[wi]
        while pc[wi] < iterations * length:
            it, j = divmod(pc[wi], length)
            i = ids[wi][j]
            dep = deps[i]
            if dep is None:  # S: wait for the whole step group
                group = (it, group_of[wi])
                arrived = at_step.setdefault(group, [])
                if wi in arrived:
                    break
                arrived.append(wi)
                if len(arrived) < group_size[group_of[wi]]:
                    break
                start = max(free[p] for p in arrived)
                for p in arrived:
                    finish(p, it, ids[p][pc[p] % lengths[p]], start)
                    if p != wi:
                        stack.append(p)
                continue
            start = free[wi]
            ends = end_t[it]
            blocked = -1
            for d, lag in dep:
                t = ends[d]
                if t is None:
                    blocked = d
                    break
                if t + lag > start:
                    start = t + lag
            if blocked >= 0:
                waiting.setdefault((it, blocked), []).append(wi)
                break
            finish(wi, it, i, start)
    if done != iterations * n:
        stuck = [workers[w] for w in range(n_workers) if pc[w] < iterations * lengths[w]]
        raise ValueError(f"simulator: the plan's op order deadlocks (stuck workers: {stuck})")
    timed = {
        w: [
            Op(op.kind, op.home, op.mb, op.stage, start_t[0][i], end_t[0][i])
            for op, i in zip(orders[wi], ids[wi], strict=True)
        ]
        for wi, w in enumerate(workers)
    }
    ends = [max((e for e in end_t[it] if e is not None), default=0.0) for it in range(iterations)]
    return timed, ends


__all__ = ["SimResult", "retime", "retime_and_simulate", "simulate"]
