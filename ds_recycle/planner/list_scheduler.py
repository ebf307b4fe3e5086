"""Greedy list scheduling of F, B, W and S ops for a given micro-batch assignment.

The assignment says which pipeline's worker at stage ``s`` runs micro-batch ``(h, k)``; without
failures every micro-batch runs in its home pipeline. The scheduler then decides the order and
times on every worker with the priorities of a ZB-H1-like schedule:

1. BackwardInput first (it is on the critical path), oldest forward first;
2. then Forward, while the worker holds fewer than ``warmup_limit`` micro-batches between F and B
   (``P - s`` in 1F1B) and fewer than ``memory_cap`` between F and W;
3. then BackwardWeight, which therefore fills the bubbles.

The default policy :data:`ZB_H1` adds two refinements that are never worse on fault-free
schedules (checked on P <= 8, m <= 4P with random costs) and reach ZB-H1's ``3m + P - 1`` with
unit costs: at stage 0 an allowed F goes before a B (a B there feeds nothing but its own W), and a
W that frees the memory slot a ready F waits for goes first. A :class:`SchedulePolicy` varies these
priorities (the heuristic planner tries several and keeps the best plan).

S of a stage starts when every W of that stage, on all its live workers, has ended (staggered),
or when every W of every stage has ended (synchronous).

The scheduler is event driven: a worker decides what to run when it becomes free or when an
input arrives, among the ops whose inputs have arrived by then, so a run costs O(ops log ops).
"""

from __future__ import annotations

import heapq
from collections import deque
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
from ds_recycle.planner.simulate import Precedences

Assignment = Mapping[tuple[int, int, int], int]
"""``(home, mb, stage) -> pipeline`` whose worker at ``stage`` runs that micro-batch."""


@dataclass(frozen=True)
class ScheduleOptions:
    decoupled: bool = True
    """Split backward into B and a deferred W; if false, W runs right after its B."""
    staggered: bool = True
    """Each stage steps when its own W are done; if false, all stages step together."""


@dataclass(frozen=True)
class SchedulePolicy:
    """Tie-breaking rules of the list scheduler. ``SchedulePolicy()`` is the plain B > F > W."""

    forward_first_stage0: bool = False
    """At stage 0 a B feeds nothing but its own W, so prefer an allowed F over a B there."""
    forward_first: bool = False
    """Prefer an allowed F over a B on every stage."""
    heavy_forward_first: bool = False
    """Prefer an allowed F over a B on workers that run more than ``microbatches`` micro-batches:
    their forwards start the long round trips that must be hidden behind their extra work."""
    unblock_memory: bool = False
    """When a ready F is held back only by the memory cap, run a ready W first to free a slot."""
    own_first: bool = False
    """Among ready forwards of the same index k, take the worker's own pipeline first."""
    extra_warmup: int = 0
    """Added to the 1F1B warm-up limit ``P - s`` (only when no explicit warmup_limit is given)."""
    w_lookahead: bool = False
    """Start a W only if no already-known F/B input arrives before the W would end."""
    heavy_warmup: bool = False
    """Workers that run more micro-batches than ``microbatches`` (re-routing survivors) may run
    forwards up to the memory cap ahead of their backwards, to cover the longer busy period."""
    reroute_warmup: int = 0
    """Added to the warm-up limit of the workers a re-routing feeds: on a pipeline that runs
    another pipeline's micro-batch at stage s, stages 0..s; on a pipeline whose micro-batch runs
    elsewhere at stage s, stages 0..s-1. Their forwards reach the survivors early enough to fill
    the survivors' warm-up bubble."""
    fill_only: bool = False
    """A forward beyond 1F1B's warm-up (``P - s`` plus ``extra_warmup``) never goes before a ready
    B: a deeper warm-up (``heavy_warmup``, a ``warmup_limit``) only fills time no B can use."""


ZB_H1 = SchedulePolicy(forward_first_stage0=True, unblock_memory=True)
"""The default policy of :func:`list_schedule`."""


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
    policy: SchedulePolicy = ZB_H1,
) -> dict[Worker, list[Op]]:
    """Return every live worker's ordered, timed ops. Raises ValueError if the assignment
    leaves some op unschedulable (for example a memory cap below 1)."""
    if memory_cap < 1:
        raise ValueError(f"memory_cap={memory_cap}: a worker must be able to hold at least 1 micro-batch")
    if costs.stages != stages:
        raise ValueError(f"cost model has {costs.stages} stages, the topology has {stages}")
    if warmup_limit is None:
        base = one_f_one_b_limit(stages)
        limit = lambda w: base(w) + policy.extra_warmup
    else:
        limit = warmup_limit
    return _schedule(pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit, policy)[0]


def list_schedule_with_precedences(
    pipelines: int,
    stages: int,
    microbatches: int,
    assignment: Assignment,
    costs: CostModel,
    memory_cap: int,
    options: ScheduleOptions = ScheduleOptions(),
    policy: SchedulePolicy = ZB_H1,
) -> tuple[dict[Worker, list[Op]], Precedences]:
    """:func:`list_schedule` (with 1F1B's warm-up limit), and the schedule's precedence graph for
    the plan simulator (``retime_and_simulate(..., precedences=...)``), with the order in which
    the ops were placed, which puts every op after its predecessors."""
    if memory_cap < 1:
        raise ValueError(f"memory_cap={memory_cap}: a worker must be able to hold at least 1 micro-batch")
    if costs.stages != stages:
        raise ValueError(f"cost model has {costs.stages} stages, the topology has {stages}")
    limit = lambda w: stages - w[1] + policy.extra_warmup
    workers, precedences = _schedule(
        pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit, policy, record=True
    )
    assert precedences is not None
    return workers, precedences


_F, _B, _W = 0, 1, 2
_KINDS = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_new_op = tuple.__new__


def _schedule(
    pipelines: int,
    stages: int,
    microbatches: int,
    assignment: Assignment,
    costs: CostModel,
    memory_cap: int,
    options: ScheduleOptions,
    limit: Callable[[Worker], int],
    policy: SchedulePolicy,
    record: bool = False,
) -> tuple[dict[Worker, list[Op]], Precedences | None]:
    """The event loop, and with ``record`` the precedences it placed the ops under.

    A micro-batch ``(h, k)`` is ``j = h m + k`` and ``(h, k, s)`` is ``j P + s``. An event
    ``(time, seq, worker)`` asks the worker to decide at ``time``; an arrival
    ``(time, seq, kind, j)`` makes an op ready at ``time``; ``seq`` numbers both in the order they
    were queued, which breaks ties between equal times. A W is ready as soon as its B ends, which
    is before its worker decides again, so the ready W wait in a queue in the order of their B."""
    D, P, m = pipelines, stages, microbatches
    expected = D * m * P
    if len(assignment) != expected:
        raise ValueError(f"assignment covers {len(assignment)} of {expected} (home, mb, stage) triples")
    for h, k, s in assignment:
        if not (0 <= h < D and 0 <= k < m and 0 <= s < P):
            raise ValueError(f"assignment names (home, mb, stage) = {(h, k, s)} outside {D} x {m} x {P}")
    workers: list[Worker] = sorted({(p, s) for (_h, _k, s), p in assignment.items()})
    index = {w: i for i, w in enumerate(workers)}
    n = len(workers)
    stage_of = [w[1] for w in workers]
    dur = [[costs.op_duration(kind, w) for w in workers] for kind in _KINDS]
    dur_f, dur_b, dur_w = dur
    runner = [0] * expected
    f_key: list[tuple] = [()] * expected
    n_mbs = [0] * n
    own_first = policy.own_first
    for (h, k, s), p in assignment.items():
        wi = index[(p, s)]
        key = (h * m + k) * P + s
        runner[key] = wi
        f_key[key] = (k, 0 if (own_first and h == p) else 1, h)
        n_mbs[wi] += 1
    limits = [max(1, limit(w)) for w in workers]
    if policy.reroute_warmup:
        fed = _fed_stages(assignment)
        for wi, (p, s) in enumerate(workers):
            if s <= fed.get(p, -1):
                limits[wi] += policy.reroute_warmup
    first_limits = [max(1, P - s + policy.extra_warmup) for s in stage_of] if policy.fill_only else limits
    heavy = [count > m for count in n_mbs]
    if policy.heavy_warmup:
        for wi in range(n):
            if heavy[wi]:
                limits[wi] = max(limits[wi], memory_cap)

    ops: list[list[Op]] = [[] for _ in range(n)]
    if record:
        first, size = [0] * n, 0
        for wi in range(n):
            first[wi] = size
            size += 3 * n_mbs[wi] + 1
        duration = [0.0] * size
        dep_a, lag_a, dep_b, lag_b = [-1] * size, [0.0] * size, [-1] * size, [0.0] * size
        f_id, b_id, w_id = [0] * expected, [0] * expected, [0] * expected
        order: list[int] = []
    free_at = [0.0] * n
    n_f, n_b, n_w = [0] * n, [0] * n, [0] * n
    arrivals: list[list] = [[] for _ in range(n)]
    ready_f: list[list] = [[] for _ in range(n)]
    ready_b: list[list] = [[] for _ in range(n)]
    ready_w: list[deque] = [deque() for _ in range(n)]
    f_seq = [0] * expected
    f_end = [0.0] * expected
    events: list = []
    push, pop = heapq.heappush, heapq.heappop
    comm = costs.comm
    last = P - 1
    decoupled = options.decoupled
    cap = memory_cap
    unblock = policy.unblock_memory
    forward_first = policy.forward_first
    forward_first_stage0 = policy.forward_first_stage0
    heavy_forward_first = policy.heavy_forward_first
    lookahead = policy.w_lookahead
    seq = 0

    for (h, k, s), p in assignment.items():
        if s == 0:
            j = h * m + k
            push(ready_f[index[(p, 0)]], (f_key[j * P], j))
    for wi in range(n):
        push(events, (0.0, seq, wi))
        seq += 1
    placed = 0
    while events:
        t, _, wi = pop(events)
        if free_at[wi] > t:
            continue
        s = stage_of[wi]
        waiting = arrivals[wi]
        rf, rb, rw = ready_f[wi], ready_b[wi], ready_w[wi]
        while waiting and waiting[0][0] <= t:
            _, _, kind, j = pop(waiting)
            if kind == _F:
                push(rf, (f_key[j * P + s], j))
            else:
                push(rb, (f_seq[j * P + s], j))
        nf, nb = n_f[wi], n_b[wi]
        f_warm = nf - nb < limits[wi]
        f_mem = nf - n_w[wi] < cap
        f_ok = f_warm and f_mem and bool(rf)
        if decoupled and rw and unblock and rf and f_warm and not f_mem:
            kind = _W
        elif (
            f_ok
            and (forward_first or (forward_first_stage0 and s == 0) or (heavy_forward_first and heavy[wi]))
            and nf - nb < first_limits[wi]
        ):
            kind = _F
        elif rb:
            kind = _B
        elif f_ok:
            kind = _F
        elif decoupled and rw:
            kind = _W
            if lookahead and waiting:
                until = t + dur_w[wi]
                if any(
                    time < until and (what == _B or (what == _F and f_warm and f_mem)) for time, _, what, _j in waiting
                ):
                    continue  # wait for it; its arrival event wakes us
        else:
            continue
        j = rw.popleft() if kind == _W else pop(rf if kind == _F else rb)[1]
        h, k = divmod(j, m)
        key = j * P + s
        if kind == _F:
            end = t + dur_f[wi]
            ops[wi].append(_new_op(Op, (FORWARD, h, k, s, t, end)))
            free_at[wi] = end
            nf += 1
            n_f[wi] = nf
            f_seq[key] = nf
            f_end[key] = end
            if record:
                i = first[wi] + len(ops[wi]) - 1
                f_id[key], duration[i] = i, dur_f[wi]
                order.append(i)
                if s > 0:
                    dep_a[i] = f_id[key - 1]
                    lag_a[i] = comm if runner[key - 1] != wi else 0.0
            if s < last:
                to, at, what = runner[key + 1], end + comm, _F
            else:
                to, at, what = wi, end, _B
            push(arrivals[to], (at, seq, what, j))
            if at >= free_at[to]:
                push(events, (at, seq, to))
            seq += 1
            placed += 1
        elif kind == _B:
            end = t + dur_b[wi]
            ops[wi].append(_new_op(Op, (BACKWARD_INPUT, h, k, s, t, end)))
            free_at[wi] = end
            n_b[wi] = nb + 1
            placed += 1
            if record:
                i = first[wi] + len(ops[wi]) - 1
                b_id[key], duration[i], dep_a[i] = i, dur_b[wi], f_id[key]
                order.append(i)
                if s < last:
                    dep_b[i] = (b_id if decoupled else w_id)[key + 1]
                    lag_b[i] = comm if runner[key + 1] != wi else 0.0
            if decoupled:
                rw.append(j)
                push(events, (end, seq, wi))
                seq += 1
                grad_at = end
            else:
                w_end = end + dur_w[wi]
                grad_at = w_end
            if s > 0:
                to = runner[key - 1]
                at = max(grad_at + comm, f_end[key - 1])
                push(arrivals[to], (at, seq, _B, j))
                if at >= free_at[to]:
                    push(events, (at, seq, to))
                seq += 1
            if not decoupled:
                push(events, (end, seq, wi))
                seq += 1
                ops[wi].append(_new_op(Op, (BACKWARD_WEIGHT, h, k, s, end, w_end)))
                free_at[wi] = end = w_end
                n_w[wi] += 1
                placed += 1
                if record:
                    i += 1
                    w_id[key], duration[i], dep_a[i] = i, dur_w[wi], i - 1
                    order.append(i)
        else:
            end = t + dur_w[wi]
            ops[wi].append(_new_op(Op, (BACKWARD_WEIGHT, h, k, s, t, end)))
            free_at[wi] = end
            n_w[wi] += 1
            placed += 1
            if record:
                i = first[wi] + len(ops[wi]) - 1
                duration[i], dep_a[i] = dur_w[wi], b_id[key]
                order.append(i)
        push(events, (end, seq, wi))
        seq += 1
    total = 3 * sum(n_mbs)
    if placed != total:
        raise ValueError(
            f"list scheduler: only {placed} of {total} ops could be placed "
            "(cyclic dependencies or memory cap too small)"
        )
    _place_steps(ops, stage_of, free_at, costs.step, options.staggered)
    schedule = {w: ops[i] for i, w in enumerate(workers)}
    if not record:
        return schedule, None
    where, group = [0] * size, [-1] * size
    for wi in range(n):
        i = first[wi] + len(ops[wi]) - 1
        where[first[wi] : i + 1] = [wi] * (i + 1 - first[wi])
        duration[i], group[i] = costs.step, stage_of[wi] if options.staggered else 0
        order.append(i)
    precedences = Precedences(
        options.staggered, options.decoupled, where, duration, dep_a, lag_a, dep_b, lag_b, group, order
    )
    return schedule, precedences


def _fed_stages(assignment: Assignment) -> dict[int, int]:
    """Pipeline -> the last stage up to which it feeds a re-routed micro-batch (see
    :attr:`SchedulePolicy.reroute_warmup`)."""
    fed: dict[int, int] = {}
    for (h, _k, s), p in assignment.items():
        if p != h:
            fed[p] = max(fed.get(p, -1), s)
            fed[h] = max(fed.get(h, -1), s - 1)
    return fed


def _place_steps(ops: list[list[Op]], stage_of: list[int], free_at: list[float], step: float, staggered: bool) -> None:
    last_w: dict[int, float] = {}
    for wi, s in enumerate(stage_of):
        last_w[s] = max(last_w.get(s, 0.0), free_at[wi])
    everything_done = max(last_w.values(), default=0.0)
    for wi, s in enumerate(stage_of):
        start = last_w[s] if staggered else everything_done
        ops[wi].append(Op(STEP, -1, -1, s, start, start + step))
