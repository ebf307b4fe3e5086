"""The Plan validator: every invariant of docs/design.md §4, one rule at a time.

``validate(plan)`` returns None for a good plan and raises :class:`PlanError` naming the first
offending op (``Op.label()``) and the rule it breaks. Times are compared with a small tolerance
``EPS`` so that plans computed in floating point (or read back from JSON) pass.
"""

from __future__ import annotations

from ds_recycle.planner.lowering import StreamError, check_streams, lower
from ds_recycle.planner.plan import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, OP_KINDS, STEP, Op, Plan, Worker

EPS = 1e-6


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the op and the rule."""


def validate(plan: Plan, *, streams: bool = True) -> None:
    """Raise PlanError unless ``plan`` satisfies every invariant of docs/design.md §4.

    ``streams=True`` also lowers the plan and checks its instruction streams, which imports
    DeepSpeed (the instruction classes subclass its own) on first use; ``streams=False`` checks
    the plan alone, in pure Python."""
    _check_workers(plan)
    runner = _check_coverage(plan)
    _check_worker_sequences(plan)
    _check_precedences(plan, runner)
    _check_steps(plan)
    _check_memory(plan)
    _check_iteration_time(plan)
    if not streams:
        return
    try:
        check_streams(lower(plan))
    except StreamError as exc:
        raise PlanError(f"lowering: {exc}") from exc


def _fail(op: Op | None, worker: Worker | None, rule: str) -> PlanError:
    where = f" on worker {worker}" if worker is not None else ""
    what = op.label() if op is not None else "plan"
    return PlanError(f"{what}{where}: {rule}")


def _check_workers(plan: Plan) -> None:
    D, P = plan.pipelines, plan.stages
    if plan.costs.stages != P:
        raise _fail(None, None, f"cost model has {plan.costs.stages} stages, the plan has {P}")
    failed = set()
    for w in plan.failed:
        p, s = w
        if not (0 <= p < D and 0 <= s < P):
            raise _fail(None, None, f"failed worker {tuple(w)} is outside the {D}x{P} grid")
        failed.add((p, s))
    for worker, ops in plan.workers.items():
        p, s = worker
        if not (0 <= p < D and 0 <= s < P):
            raise _fail(None, worker, f"worker {worker} is outside the {D}x{P} grid")
        if worker in failed:
            bad = ops[0] if ops else None
            raise _fail(bad, worker, "runs on a failed worker")
        for op in ops:
            if op.kind not in OP_KINDS:
                raise _fail(op, worker, f"unknown op kind {op.kind!r}")
            if op.stage != s:
                raise _fail(op, worker, f"op.stage {op.stage} differs from the worker's stage {s}")
    for p in range(D):
        for s in range(P):
            if (p, s) not in failed and (p, s) not in plan.workers:
                raise _fail(None, (p, s), "live worker has no op list (every live worker needs its S)")


def _check_coverage(plan: Plan) -> dict[tuple[str, int, int, int], Worker]:
    """Exactly one F, B and W per (h, k, s), all on the same worker of stage s."""
    D, P, m = plan.pipelines, plan.stages, plan.microbatches
    runner: dict[tuple[str, int, int, int], Worker] = {}
    for worker, ops in plan.workers.items():
        for op in ops:
            if op.kind == STEP:
                if op.home != -1 or op.mb != -1:
                    raise _fail(op, worker, "S must have home == mb == -1")
                continue
            if not (0 <= op.home < D and 0 <= op.mb < m):
                raise _fail(op, worker, f"micro-batch ({op.home},{op.mb}) is outside D={D}, m={m}")
            key = (op.kind, op.home, op.mb, op.stage)
            if key in runner:
                raise _fail(op, worker, f"duplicate op (already on worker {runner[key]})")
            runner[key] = worker
    for h in range(D):
        for k in range(m):
            for s in range(P):
                f = runner.get((FORWARD, h, k, s))
                for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                    where = runner.get((kind, h, k, s))
                    label = Op(kind, h, k, s).label()
                    if where is None:
                        raise PlanError(f"{label}: missing (every (h,k,s) needs exactly one F, one B and one W)")
                    if where != f:
                        raise PlanError(
                            f"{label} on worker {where}: F, B and W of one (h,k,s) must share a worker (F runs on {f})"
                        )
    return runner


def _check_worker_sequences(plan: Plan) -> None:
    """Durations match the cost model; ops are listed in start order and do not overlap."""
    costs = plan.costs
    for worker, ops in plan.workers.items():
        prev: Op | None = None
        for op in ops:
            want = costs.op_duration(op.kind, worker)
            if op.start < -EPS:
                raise _fail(op, worker, f"starts at negative time {op.start}")
            if abs((op.end - op.start) - want) > EPS:
                raise _fail(op, worker, f"duration {op.end - op.start:g} differs from the cost model's {want:g}")
            if prev is not None:
                if op.start < prev.start - EPS:
                    raise _fail(op, worker, f"ops are not listed in start order (starts before {prev.label()})")
                if op.start < prev.end - EPS:
                    raise _fail(op, worker, f"overlaps {prev.label()} on the same worker")
            prev = op


def _check_precedences(plan: Plan, runner: dict[tuple[str, int, int, int], Worker]) -> None:
    P, comm = plan.stages, plan.costs.comm
    times: dict[tuple[str, int, int, int], Op] = {}
    for ops in plan.workers.values():
        for op in ops:
            if op.kind != STEP:
                times[(op.kind, op.home, op.mb, op.stage)] = op

    def after(op: Op, dep_key: tuple[str, int, int, int], rule: str) -> None:
        dep = times[dep_key]
        lag = comm if runner[dep_key] != runner[(op.kind, op.home, op.mb, op.stage)] else 0.0
        if op.start < dep.end + lag - EPS:
            extra = f" + comm {comm:g}" if lag else ""
            raise _fail(
                op,
                runner[(op.kind, op.home, op.mb, op.stage)],
                f"{rule}: starts at {op.start:g} before {dep.label()} ends at {dep.end:g}{extra}",
            )

    for (kind, h, k, s), op in sorted(times.items(), key=lambda item: item[1].start):
        if kind == FORWARD and s > 0:
            after(op, (FORWARD, h, k, s - 1), "F must follow F of the previous stage")
        elif kind == BACKWARD_INPUT:
            if s < P - 1:
                after(op, (BACKWARD_INPUT, h, k, s + 1), "B must follow B of the next stage")
            after(op, (FORWARD, h, k, s), "B must follow its own F")
        elif kind == BACKWARD_WEIGHT:
            after(op, (BACKWARD_INPUT, h, k, s), "W must follow its B")


def _check_steps(plan: Plan) -> None:
    """Each live worker has exactly one S, after every W of its stage on every live worker."""
    last_w: dict[int, float] = {}
    for ops in plan.workers.values():
        for op in ops:
            if op.kind == BACKWARD_WEIGHT:
                last_w[op.stage] = max(last_w.get(op.stage, 0.0), op.end)
    for worker, ops in plan.workers.items():
        steps = [op for op in ops if op.kind == STEP]
        if len(steps) != 1:
            first = steps[1] if steps else None
            raise _fail(first, worker, f"each live worker needs exactly one S, found {len(steps)}")
        step = steps[0]
        if step.start < last_w.get(worker[1], 0.0) - EPS:
            raise _fail(
                step,
                worker,
                f"S must follow every W of stage {worker[1]}: starts at {step.start:g}, "
                f"the last W ends at {last_w[worker[1]]:g}",
            )


def _check_memory(plan: Plan) -> None:
    """At no moment more than memory_cap micro-batches between the start of F and the end of W."""
    cap = plan.memory_cap
    for worker, ops in plan.workers.items():
        events = []  # (time, order, delta, op): releases (W ends) before acquisitions at equal times
        for op in ops:
            if op.kind == FORWARD:
                events.append((op.start, 1, 1, op))
            elif op.kind == BACKWARD_WEIGHT:
                events.append((op.end, 0, -1, op))
        held = 0
        for _time, _order, delta, op in sorted(events, key=lambda e: (e[0], e[1])):
            held += delta
            if held > cap:
                raise _fail(op, worker, f"memory cap: {held} micro-batches held between F and W, cap is {cap}")


def _check_iteration_time(plan: Plan) -> None:
    if plan.iteration_time:
        makespan = max((op.end for ops in plan.workers.values() for op in ops), default=0.0)
        if abs(makespan - plan.iteration_time) > EPS * max(1.0, makespan):
            raise PlanError(f"plan: iteration_time {plan.iteration_time:g} differs from the makespan {makespan:g}")
