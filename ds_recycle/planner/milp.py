"""The MILP planner (python-mip): an exact schedule for small failure sets, warm-started from the heuristic.

Model, for one (topology, failure set, costs, memory cap):

- **ops**: ``F``, ``B`` and ``W`` of every ``(h, k, s)``; all three run on the same worker of stage ``s``.
- **assignment**: a micro-batch whose home worker ``(h, s)`` is alive stays there; one whose home
  worker is dead gets binaries ``x[h,k,s,q]`` (``sum_q x = 1``) over the survivors ``q`` of stage ``s``.
  (If the warm start moved a healthy micro-batch, its home and its warm-start runner are both candidates.)
- **times**: a start ``t`` per op, one step start per stage and the makespan ``C`` (objective).
- **precedences** (docs/design.md §4): ``F(s-1) -> F(s)`` and ``B(s+1) -> B(s)`` pay the p2p latency ``comm``.
  Producer and consumer sit on different stages, hence always on different workers, so the
  latency is a constant and needs no linearization. ``F -> B -> W`` on the same worker. Without
  decoupled backprop, ``W`` starts when its ``B`` ends and the input gradient leaves after ``W``.
- **no overlap**: for two ops that can share a worker and whose order is not already implied,
  an ordering binary ``o`` with big-M disjunctions, active only if both sit on that worker
  (``same``, linearized from the assignment binaries). ``M`` is the warm start's makespan,
  which is also an upper bound on ``C``.
- **memory cap**: at every ``F_i`` start, ``1 + sum_j ([F_j before F_i] - [W_j before F_i]) <= cap``
  over the other micro-batches ``j`` of that worker; both brackets are order relations (constants
  or ``o``), so no extra binaries are needed.
- **step**: ``S`` of a stage starts after every ``W`` of the stage (staggered) or of every stage
  (synchronous); ``C >= S end``.

Model-size reductions (each keeps the warm start feasible):

- the order of two ops is a constant when precedences imply it (transitive closure of the
  precedence graph plus the fixed orders below);
- same-kind ops of one home pipeline on one worker keep the warm start's relative order
  (1F1B order on a survivor's own micro-batches, FIFO for re-routed ones);
- with ``order_window`` set, two ops whose warm-start starts are further apart than the window
  keep the warm start's relative order; :func:`plan_milp` picks a window automatically when the
  full model would have more than ``max_binaries`` ordering binaries.

The solution's per-worker order and assignment are then re-timed (earliest start for that order),
which can only shorten it, and the MILP never returns anything worse than its warm start: if the
solver finds nothing better, the warm start's schedule is returned relabelled ``solver="milp"``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import mip

from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.plan import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    STEP,
    CostModel,
    Op,
    Plan,
    Worker,
)
from ds_recycle.planner.request import PlanRequest
from ds_recycle.planner.simulate import retime as sim_retime

OpKey = tuple[str, int, int, int]
"""``(kind, home, mb, stage)`` of an F, B or W op."""
Triple = tuple[int, int, int]
"""``(home, mb, stage)``."""

_EPS = 1e-6


@dataclass(frozen=True)
class MilpStats:
    """What the solver did; stored in ``Plan.extra["milp"]``."""

    solver_name: str
    status: str
    binaries: int
    constraints: int
    order_window: float | None
    warm_start_time: float
    objective_bound: float
    improved: bool
    build_seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def available_solver() -> str:
    """``HIGHS`` when python-mip can load it (the ``mip[highs]`` extra), else ``CBC``."""
    log = logging.getLogger("mip")
    level = log.level
    log.setLevel(logging.CRITICAL)  # mip logs an error when the HiGHS library is missing
    try:
        mip.Model(solver_name=mip.HIGHS)
    except Exception:
        return mip.CBC
    finally:
        log.setLevel(level)
    return mip.HIGHS


def plan_milp(
    pipelines: int,
    stages: int,
    microbatches: int,
    failed: Iterable[Worker] = (),
    costs: CostModel | None = None,
    memory_cap: int | None = None,
    options: ScheduleOptions = ScheduleOptions(),
    time_limit: float = 10.0,
    warm_start: Plan | None = None,
    order_window: float | None = None,
    max_binaries: int = 4000,
    lns_share: float = 0.5,
    threads: int = 1,
    solver_name: str | None = None,
) -> Plan:
    """Solve the scheduling MILP for ``failed`` and return a validated Plan with ``solver="milp"``,
    ``gap`` (relative, 0 when proved optimal) and ``solve_seconds`` (model build + warm start + solve).

    ``warm_start`` defaults to the heuristic's plan. ``order_window=None`` builds the full model
    unless it would exceed ``max_binaries`` ordering/assignment binaries, in which case the
    window shrinks until it fits."""
    from ds_recycle.planner.heuristic import plan_heuristic
    from ds_recycle.planner.lower_bound import bound_parts
    from ds_recycle.planner.validator import validate

    began = time.perf_counter()
    if memory_cap is None and warm_start is not None:
        memory_cap = warm_start.memory_cap
    request = PlanRequest(pipelines, stages, microbatches, failed, costs, memory_cap, options)
    failed, costs, cap = request.failed, request.costs, request.memory_cap
    bound = bound_parts(request).value  # raises NoSurvivorError
    if warm_start is None:
        warm_start = plan_heuristic(pipelines, stages, microbatches, failed, costs, cap, options)
    _check_warm_start(warm_start, pipelines, stages, microbatches, failed, costs, cap)
    validate(warm_start)
    warm_time = _makespan(warm_start.workers)

    deadline = began + max(0.1, time_limit)
    if warm_time <= bound + _EPS:
        return _finish(
            warm_start,
            options,
            bound,
            began,
            MilpStats(
                available_solver(),
                "WARM_START_AT_BOUND",
                0,
                0,
                None,
                warm_time,
                bound,
                False,
                0.0,
                ["the warm start meets the lower bound"],
            ),
            0.0,
        )
    builder = _ModelBuilder(
        pipelines, stages, microbatches, failed, costs, cap, options, warm_start, bound, solver_name, threads
    )
    window = order_window
    if window is None and builder.count_binaries(None) > max_binaries:
        window = builder.fit_window(max_binaries)
    builder.build(window)
    build_seconds = time.perf_counter() - began
    remaining = deadline - time.perf_counter()
    status = builder.solve(max(0.1, remaining * (1.0 - lns_share)))
    incumbent, improved = warm_start, False
    if builder.model.num_solutions > 0:
        candidate = builder.extract()
        if _makespan(candidate) < warm_time - _EPS:
            incumbent, improved = _relabel(warm_start, candidate), True
    proved = status == mip.OptimizationStatus.OPTIMAL and window is None
    objective_bound = max(bound, builder.objective_bound())
    rounds = 0
    if not proved and objective_bound < _makespan(incumbent.workers) - _EPS:
        incumbent, rounds, lns_improved = _neighbourhood_search(
            incumbent, failed, costs, cap, options, bound, builder.solver_name, threads, deadline
        )
        improved = improved or lns_improved
    iteration_time = _makespan(incumbent.workers)
    if proved and not improved:
        objective_bound = max(objective_bound, iteration_time)
    gap = max(0.0, (iteration_time - objective_bound) / iteration_time) if iteration_time > 0 else 0.0
    if gap < 1e-9:
        gap = 0.0
    builder.notes.append(f"{rounds} neighbourhood-search rounds")
    stats = MilpStats(
        solver_name=builder.solver_name,
        status=status.name,
        binaries=builder.binaries,
        constraints=builder.model.num_rows,
        order_window=window,
        warm_start_time=warm_time,
        objective_bound=objective_bound,
        improved=improved,
        build_seconds=build_seconds,
        notes=builder.notes,
    )
    return _finish(incumbent, options, bound, began, stats, gap)


def _finish(
    incumbent: Plan, options: ScheduleOptions, bound: float, began: float, stats: MilpStats, gap: float
) -> Plan:
    from ds_recycle.planner.validator import validate

    plan = Plan(
        pipelines=incumbent.pipelines,
        stages=incumbent.stages,
        microbatches=incumbent.microbatches,
        failed=tuple(sorted(tuple(w) for w in incumbent.failed)),
        costs=incumbent.costs,
        memory_cap=incumbent.memory_cap,
        workers={w: list(ops) for w, ops in incumbent.workers.items()},
        iteration_time=_makespan(incumbent.workers),
        lower_bound=bound,
        solver="milp",
        gap=gap,
        extra={"decoupled": options.decoupled, "staggered": options.staggered, "milp": stats.to_dict()},
    )
    plan.steady_state_period = _steady_state_period(plan)
    plan.solve_seconds = time.perf_counter() - began
    validate(plan)
    return plan


def _relabel(template: Plan, workers: dict[Worker, list[Op]]) -> Plan:
    return Plan(
        template.pipelines,
        template.stages,
        template.microbatches,
        tuple(template.failed),
        template.costs,
        template.memory_cap,
        workers,
        iteration_time=_makespan(workers),
        solver="milp",
    )


def _neighbourhood_search(
    incumbent: Plan,
    failed: tuple,
    costs: CostModel,
    cap: int,
    options: ScheduleOptions,
    lower: float,
    solver_name: str,
    threads: int,
    deadline: float,
) -> tuple[Plan, int, bool]:
    """Large-neighbourhood search: re-solve the MILP with everything outside a time interval of the
    incumbent kept as it is (assignment and order), the interval sliding over the schedule; keep
    any improvement. Returns (best plan, rounds, improved)."""
    rounds, improved = 0, False
    widths = (0.35, 0.5, 0.25)
    position = 0
    stale = 0
    while time.perf_counter() < deadline - 0.05:
        span = _makespan(incumbent.workers)
        if span <= lower + _EPS:
            break
        width = span * widths[(rounds // 4) % len(widths)]
        starts = max(1, int(round(span / (width / 2))))
        lo = (position % starts) * width / 2
        position += 1
        builder = _ModelBuilder(
            incumbent.pipelines,
            incumbent.stages,
            incumbent.microbatches,
            failed,
            costs,
            cap,
            options,
            incumbent,
            lower,
            solver_name,
            threads,
            free_interval=(lo, lo + width),
        )
        builder.build(None)
        limit = min(deadline - time.perf_counter(), 2.0)
        if limit <= 0.05:
            break
        builder.solve(limit)
        rounds += 1
        stale += 1
        if builder.model.num_solutions > 0:
            candidate = builder.extract()
            if _makespan(candidate) < span - _EPS:
                incumbent, improved, stale = _relabel(incumbent, candidate), True, 0
        if stale > 3 * starts * len(widths):
            break
    return incumbent, rounds, improved


def _makespan(workers: dict[Worker, list[Op]]) -> float:
    return max((op.end for ops in workers.values() for op in ops), default=0.0)


def _steady_state_period(plan: Plan) -> float:
    from ds_recycle.planner.simulate import simulate

    return float(simulate(plan, iterations=4).steady_state_period)


def _check_warm_start(
    warm: Plan, pipelines: int, stages: int, microbatches: int, failed: tuple, costs: CostModel, cap: int
) -> None:
    problems = []
    if (warm.pipelines, warm.stages, warm.microbatches) != (pipelines, stages, microbatches):
        problems.append(f"topology {(warm.pipelines, warm.stages, warm.microbatches)}")
    if tuple(sorted(tuple(w) for w in warm.failed)) != failed:
        problems.append(f"failure set {sorted(warm.failed)}")
    if warm.costs != costs:
        problems.append("cost model")
    if warm.memory_cap > cap:
        problems.append(f"memory cap {warm.memory_cap} > {cap}")
    if problems:
        raise ValueError("plan_milp: the warm start does not match the problem: " + ", ".join(problems))


class _ModelBuilder:
    """Builds, solves and reads back the MILP; see the module docstring for the model."""

    def __init__(self, D, P, m, failed, costs, cap, options, warm, lower, solver_name, threads, free_interval=None):
        self.D, self.P, self.m = D, P, m
        self.costs, self.cap, self.options = costs, cap, options
        self.warm = warm
        self.lower = lower
        self.notes: list[str] = []
        dead = set(failed)
        self.survivors = {s: [p for p in range(D) if (p, s) not in dead] for s in range(P)}
        self.warm_runner: dict[Triple, int] = {}
        self.warm_start_of: dict[OpKey, float] = {}
        self.warm_pos: dict[OpKey, int] = {}
        for (p, _s), ops in warm.workers.items():
            for pos, op in enumerate(ops):
                if op.kind == STEP:
                    continue
                key = (op.kind, op.home, op.mb, op.stage)
                self.warm_runner[(op.home, op.mb, op.stage)] = p
                self.warm_start_of[key] = op.start
                self.warm_pos[key] = pos
        self.cand: dict[Triple, list[int]] = {}
        for h in range(D):
            for k in range(m):
                for s in range(P):
                    home = [h] if (h, s) not in dead else self.survivors[s]
                    extra = self.warm_runner[(h, k, s)]
                    self.cand[(h, k, s)] = sorted(set(home) | {extra})
        self.free_interval = free_interval
        if free_interval is not None:
            lo, hi = free_interval
            for (h, k, s), cands in self.cand.items():
                first, last = self.warm_start_of[(FORWARD, h, k, s)], self.warm_start_of[(BACKWARD_WEIGHT, h, k, s)]
                if len(cands) > 1 and not (first < hi and last + self.costs.W[s] > lo):
                    self.cand[(h, k, s)] = [self.warm_runner[(h, k, s)]]
        self.ops: list[OpKey] = [
            (kind, h, k, s) for (h, k, s) in self.cand for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
        ]
        self.index = {op: i for i, op in enumerate(self.ops)}
        self._pred = self._precedence_edges()
        self.solver_name = solver_name or available_solver()
        self.threads = threads
        self.model: mip.Model | None = None
        self.binaries = 0

    # ----- structure ---------------------------------------------------------------------------

    def fixed(self, triple: Triple) -> bool:
        return len(self.cand[triple]) == 1

    def duration(self, op: OpKey) -> float:
        return self.costs.duration(op[0], op[3])

    def _precedence_edges(self) -> dict[OpKey, list[tuple[OpKey, float]]]:
        """pred[b] = [(a, lag)]: ``t_b >= t_a + d_a + lag``."""
        comm = self.costs.comm
        pred: dict[OpKey, list[tuple[OpKey, float]]] = {op: [] for op in self.ops}
        for h, k, s in self.cand:
            f, b, w = (FORWARD, h, k, s), (BACKWARD_INPUT, h, k, s), (BACKWARD_WEIGHT, h, k, s)
            if s > 0:
                pred[f].append(((FORWARD, h, k, s - 1), comm))
            pred[b].append((f, 0.0))
            if s < self.P - 1:
                upstream = BACKWARD_INPUT if self.options.decoupled else BACKWARD_WEIGHT
                pred[b].append(((upstream, h, k, s + 1), comm))
            pred[w].append((b, 0.0))
        return pred

    def _forced_pairs(self, window: float | None) -> list[tuple[OpKey, OpKey, bool]]:
        """(a, b, unconditional): a runs before b whenever both are on one worker. Unconditional pairs
        (both pinned to the same worker) also feed the closure.

        Same-kind ops of one home pipeline at one stage keep the warm start's order when the warm start
        ran them on one worker, and micro-batch order otherwise (1F1B / FIFO)."""
        out = []
        by_stage: dict[int, list[OpKey]] = {}
        for op in self.ops:
            by_stage.setdefault(op[3], []).append(op)
        for s, ops in by_stage.items():
            groups: dict[tuple[str, int], list[OpKey]] = {}
            for op in ops:
                groups.setdefault((op[0], op[1]), []).append(op)
            for group in groups.values():
                pinned = sorted((op for op in group if self.fixed(op[1:])), key=self._warm_key)
                by_worker: dict[int, list[OpKey]] = {}
                for op in pinned:
                    by_worker.setdefault(self.cand[op[1:]][0], []).append(op)
                for chain in by_worker.values():
                    out.extend((a, b, True) for a, b in zip(chain, chain[1:], strict=False))
                for i, a in enumerate(group):
                    for b in group[i + 1 :]:
                        if self.fixed(a[1:]) and self.fixed(b[1:]):
                            continue
                        if not set(self.cand[a[1:]]) & set(self.cand[b[1:]]):
                            continue
                        out.append((a, b, False) if self._group_first(a, b) else (b, a, False))
            if self.free_interval is not None:
                out.extend(self._outside_interval_pairs(s))
            if window is not None:
                for worker_ops in self._pinned_ops_by_worker(s).values():
                    worker_ops.sort(key=self._warm_key)
                    for i, a in enumerate(worker_ops):
                        for b in worker_ops[i + 1 :]:
                            if self.warm_start_of[b] - self.warm_start_of[a] > window:
                                out.append((a, b, True))
        return out

    def _outside_interval_pairs(self, s: int) -> list[tuple[OpKey, OpKey, bool]]:
        """Pinned ops that start outside the free interval keep the warm start's order, among themselves
        and relative to the pinned ops inside it (those start in one contiguous block)."""
        lo, hi = self.free_interval
        out = []
        for worker_ops in self._pinned_ops_by_worker(s).values():
            worker_ops.sort(key=self._warm_key)
            inside = [lo <= self.warm_start_of[op] < hi for op in worker_ops]
            outside = [op for op, flag in zip(worker_ops, inside, strict=False) if not flag]
            out.extend((a, b, True) for a, b in zip(outside, outside[1:], strict=False))
            block = [op for op, flag in zip(worker_ops, inside, strict=False) if flag]
            if not block:
                continue
            first = inside.index(True)
            before = [op for op in worker_ops[:first]]
            after = [op for op in worker_ops[first + len(block) :]]
            for op in block:
                if before:
                    out.append((before[-1], op, True))
                if after:
                    out.append((op, after[0], True))
        return out

    def _warm_key(self, op: OpKey):
        return (self.warm_start_of[op], self.warm_pos[op])

    def _group_first(self, a: OpKey, b: OpKey) -> bool:
        if self.warm_runner[a[1:]] == self.warm_runner[b[1:]]:
            return self._warm_key(a) < self._warm_key(b)
        return a[2] < b[2]

    def _pinned_ops_by_worker(self, s: int) -> dict[int, list[OpKey]]:
        out: dict[int, list[OpKey]] = {}
        for op in self.ops:
            if op[3] == s and self.fixed(op[1:]):
                out.setdefault(self.cand[op[1:]][0], []).append(op)
        return out

    def _closure(self, forced: list[tuple[OpKey, OpKey, bool]]) -> list[int]:
        """reach[i]: bitmask of the ops that op i must precede."""
        succ: dict[int, list[int]] = {i: [] for i in range(len(self.ops))}
        indeg = [0] * len(self.ops)
        for b, preds in self._pred.items():
            for a, _lag in preds:
                succ[self.index[a]].append(self.index[b])
                indeg[self.index[b]] += 1
        for a, b, unconditional in forced:
            if unconditional:
                succ[self.index[a]].append(self.index[b])
                indeg[self.index[b]] += 1
        order = [i for i in range(len(self.ops)) if indeg[i] == 0]
        head = 0
        while head < len(order):
            i = order[head]
            head += 1
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    order.append(j)
        if len(order) != len(self.ops):
            raise ValueError("plan_milp: the precedences and the warm start's fixed orders form a cycle")
        self.topo = {i: pos for pos, i in enumerate(order)}
        self._time_windows(order, forced)
        reach = [0] * len(self.ops)
        for i in reversed(order):
            mask = 0
            for j in succ[i]:
                mask |= reach[j] | (1 << j)
            reach[i] = mask
        return reach

    def _time_windows(self, order: list[int], forced: list[tuple[OpKey, OpKey, bool]]) -> None:
        """est: earliest start by the longest precedence path from time 0; lst: the warm start's makespan
        minus the longest path to the end (through W and the step). Any schedule no longer than the warm
        start, the warm start included, lies in these windows."""
        edges: dict[OpKey, list[tuple[OpKey, float]]] = {op: list(preds) for op, preds in self._pred.items()}
        for a, b, unconditional in forced:
            if unconditional:
                edges[b].append((a, 0.0))
        succ: dict[OpKey, list[tuple[OpKey, float]]] = {op: [] for op in self.ops}
        for b, preds in edges.items():
            for a, lag in preds:
                succ[a].append((b, lag))
        ops = [self.ops[i] for i in order]
        self.est = {}
        for op in ops:
            self.est[op] = max((self.est[a] + self.duration(a) + lag for a, lag in edges[op]), default=0.0)
        ub = _makespan(self.warm.workers)
        tail = {}
        for op in reversed(ops):
            after = self.costs.step if op[0] == BACKWARD_WEIGHT else 0.0
            after = max([after] + [lag + tail[b] for b, lag in succ[op]])
            tail[op] = self.duration(op) + after
        self.lst = {op: ub - tail[op] for op in ops}

    def _big_m(self, first: OpKey, second: OpKey) -> float:
        """Enough to relax ``t_second >= t_first + d_first``."""
        return max(0.0, self.lst[first] + self.duration(first) - self.est[second])

    def _pairs(self, reach: list[int], forced: list[tuple[OpKey, OpKey, bool]]):
        """Every pair of ops that can share a worker: (a, b, order) with order True (a first), False
        (b first), a forced-if-same-worker order, or None (needs a binary)."""
        forced_if_same = {(a, b) for a, b, unconditional in forced if not unconditional}
        by_stage: dict[int, list[OpKey]] = {}
        for op in self.ops:
            by_stage.setdefault(op[3], []).append(op)
        pairs = []
        for ops in by_stage.values():
            for i, a in enumerate(ops):
                ia, ca = self.index[a], set(self.cand[a[1:]])
                for b in ops[i + 1 :]:
                    if not ca.intersection(self.cand[b[1:]]):
                        continue
                    ib = self.index[b]
                    if reach[ia] >> ib & 1:
                        order = True
                    elif reach[ib] >> ia & 1:
                        order = False
                    elif (a, b) in forced_if_same:
                        order = True
                    elif (b, a) in forced_if_same:
                        order = False
                    else:
                        order = None
                    pairs.append((a, b, order))
        return pairs

    def count_binaries(self, window: float | None) -> int:
        forced = self._forced_pairs(window)
        pairs = self._pairs(self._closure(forced), forced)
        return sum(1 for _a, _b, order in pairs if order is None)

    def fit_window(self, max_binaries: int) -> float:
        lo, hi = 0.0, max(self.warm_start_of.values(), default=1.0) + 1.0
        for _ in range(12):
            mid = (lo + hi) / 2
            if self.count_binaries(mid) > max_binaries:
                hi = mid
            else:
                lo = mid
        self.notes.append(f"order window {lo:.3g}: full model above {max_binaries} ordering binaries")
        return lo

    # ----- model -------------------------------------------------------------------------------

    def build(self, window: float | None) -> None:
        model = mip.Model(sense=mip.MINIMIZE, solver_name=self.solver_name)
        model.verbose = 0
        model.threads = self.threads
        self.model = model
        ub = _makespan(self.warm.workers)
        forced = self._forced_pairs(window)
        reach = self._closure(forced)
        pairs = self._pairs(reach, forced)

        self.x: dict[tuple[Triple, int], mip.Var] = {}
        for triple, cands in self.cand.items():
            if len(cands) > 1:
                for q in cands:
                    self.x[(triple, q)] = model.add_var(var_type=mip.BINARY, name=f"x_{_name(triple)}_{q}")
                model += mip.xsum(self.x[(triple, q)] for q in cands) == 1
        self.t = {
            op: model.add_var(lb=self.est[op], ub=max(self.est[op], self.lst[op]), name=f"t_{op[0]}_{_name(op[1:])}")
            for op in self.ops
        }
        self.ts = {s: model.add_var(lb=0.0, ub=ub, name=f"step_{s}") for s in range(self.P)}
        self.C = model.add_var(lb=self.lower, ub=ub, name="makespan")
        model.objective = mip.minimize(self.C)

        for b, preds in self._pred.items():
            for a, lag in preds:
                model += self.t[b] >= self.t[a] + self.duration(a) + lag
        for a, b, unconditional in forced:
            if unconditional:
                model += self.t[b] >= self.t[a] + self.duration(a)
        if not self.options.decoupled:
            for h, k, s in self.cand:
                b, w = (BACKWARD_INPUT, h, k, s), (BACKWARD_WEIGHT, h, k, s)
                model += self.t[w] == self.t[b] + self.duration(b)
        for op in self.ops:
            if op[0] == BACKWARD_WEIGHT:
                stages = [op[3]] if self.options.staggered else range(self.P)
                for s in stages:
                    model += self.ts[s] >= self.t[op] + self.duration(op)
        for s in range(self.P):
            model += self.C >= self.ts[s] + self.costs.step
        self._load_cuts()

        self.same: dict[tuple[OpKey, OpKey], object] = {}
        self.o: dict[tuple[OpKey, OpKey], mip.Var] = {}
        self.order: dict[tuple[OpKey, OpKey], object] = {}
        for a, b, order in pairs:
            same = self._same(a, b)
            if order is None:
                var = model.add_var(var_type=mip.BINARY, name=f"o_{self.index[a]}_{self.index[b]}")
                self.o[(a, b)] = var
                m_ab, m_ba = self._big_m(a, b), self._big_m(b, a)
                model += self.t[b] >= self.t[a] + self.duration(a) - m_ab * (1 - var) - m_ab * (1 - same)
                model += self.t[a] >= self.t[b] + self.duration(b) - m_ba * var - m_ba * (1 - same)
                self.order[(a, b)] = var
            else:
                first, second = (a, b) if order else (b, a)
                self.order[(a, b)] = 1 if order else 0
                if not (reach[self.index[first]] >> self.index[second] & 1):
                    big_m = self._big_m(first, second)
                    if big_m > 0:
                        model += self.t[second] >= self.t[first] + self.duration(first) - big_m * (1 - same)
        self._memory_constraints()
        self.binaries = len(self.x) + len(self.o)
        self._warm_start_values()

    def _same(self, a: OpKey, b: OpKey):
        """1 (or a linear expression equal to 1) iff a and b run on the same worker."""
        ta, tb = a[1:], b[1:]
        if ta == tb:
            return 1
        key = (ta, tb) if ta < tb else (tb, ta)
        if key in self.same:
            return self.same[key]
        ca, cb = self.cand[ta], self.cand[tb]
        common = sorted(set(ca) & set(cb))
        if self.fixed(ta) and self.fixed(tb):
            value = 1 if common else 0
        elif self.fixed(ta):
            value = self.x[(tb, ca[0])]
        elif self.fixed(tb):
            value = self.x[(ta, cb[0])]
        else:
            var = self.model.add_var(lb=0.0, ub=1.0, name=f"same_{_name(ta)}_{_name(tb)}")
            for q in common:
                self.model += var >= self.x[(ta, q)] + self.x[(tb, q)] - 1
            value = var
        self.same[key] = value
        return value

    def _on(self, triple: Triple, q: int):
        return 1 if self.fixed(triple) else self.x[(triple, q)]

    def _before(self, a: OpKey, b: OpKey):
        """[a before b] as a constant or a variable, for two ops that can share a worker."""
        if (a, b) in self.order:
            return self.order[(a, b)]
        value = self.order[(b, a)]
        return 1 - value

    def _load_cuts(self) -> None:
        """C >= earliest start of the stage + the worker's total work + step: cheap and it tightens the bound."""
        comm = self.costs.comm
        head = [sum(self.costs.F[j] + comm for j in range(s)) for s in range(self.P)]
        for s in range(self.P):
            work = self.costs.F[s] + self.costs.B[s] + self.costs.W[s]
            for q in self.survivors[s]:
                terms = [self._on(t, q) for t in self.cand if t[2] == s and q in self.cand[t]]
                load = mip.xsum(terms[i] * work for i in range(len(terms)) if not isinstance(terms[i], int))
                fixed_load = work * sum(1 for term in terms if isinstance(term, int))
                self.model += self.C >= head[s] + fixed_load + load + self.costs.step

    def _memory_constraints(self) -> None:
        cap = self.cap
        for s in range(self.P):
            triples = [t for t in self.cand if t[2] == s]
            for ti in triples:
                fi = (FORWARD, *ti)
                for q in self.cand[ti]:
                    terms = []
                    for tj in triples:
                        if tj == ti or q not in self.cand[tj]:
                            continue
                        fj, wj = (FORWARD, *tj), (BACKWARD_WEIGHT, *tj)
                        active = self._before(fj, fi)
                        released = self._before(wj, fi)
                        if isinstance(active, int) and isinstance(released, int):
                            if active - released > 0:
                                terms.append(1 if self.fixed(tj) else self.x[(tj, q)])
                            continue
                        expr = active - released
                        if self.fixed(tj):
                            terms.append(expr)
                        else:
                            c = self.model.add_var(lb=0.0, ub=1.0, name=f"mem_{_name(ti)}_{_name(tj)}_{q}")
                            self.model += c >= expr - (1 - self.x[(tj, q)])
                            terms.append(c)
                    if len(terms) < cap:
                        continue
                    relax = 0 if self.fixed(ti) else len(terms) * (1 - self.x[(ti, q)])
                    self.model += mip.xsum(terms) <= cap - 1 + relax

    def _warm_start_values(self) -> None:
        start: list[tuple[mip.Var, float]] = []
        for (triple, q), var in self.x.items():
            start.append((var, 1.0 if self.warm_runner[triple] == q else 0.0))
        for op, var in self.t.items():
            start.append((var, self.warm_start_of[op]))
        for (a, b), var in self.o.items():
            start.append((var, 1.0 if self._warm_key(a) < self._warm_key(b) else 0.0))
        self.model.start = start

    # ----- solve and read back ----------------------------------------------------------------

    def solve(self, time_limit: float) -> mip.OptimizationStatus:
        return self.model.optimize(max_seconds=time_limit)

    def objective_bound(self) -> float:
        bound = self.model.objective_bound
        return float(bound) if bound is not None and bound == bound and abs(bound) < 1e20 else self.lower

    def extract(self) -> dict[Worker, list[Op]]:
        runner = {}
        for triple, cands in self.cand.items():
            if len(cands) == 1:
                runner[triple] = cands[0]
            else:
                runner[triple] = max(cands, key=lambda q: self.x[(triple, q)].x)
        seq: dict[Worker, list[OpKey]] = {}
        for op in self.ops:
            seq.setdefault((runner[op[1:]], op[3]), []).append(op)
        untimed: dict[Worker, list[Op]] = {}
        for worker, ops in seq.items():
            ops.sort(key=lambda op: (round(self.t[op].x, 6), self.topo[self.index[op]]))
            untimed[worker] = [Op(*op) for op in ops] + [Op(STEP, -1, -1, worker[1])]
        order = Plan(self.D, self.P, self.m, (), self.costs, self.cap, untimed)
        return sim_retime(order, staggered=self.options.staggered, decoupled=self.options.decoupled).workers


def _name(triple: Triple) -> str:
    return "_".join(str(v) for v in triple)
