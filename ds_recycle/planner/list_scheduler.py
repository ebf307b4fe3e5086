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
import itertools
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
    state = _SchedulerState(pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit, policy)
    return state.run()


class _SchedulerState:
    def __init__(self, pipelines, stages, microbatches, assignment, costs, memory_cap, options, limit, policy):
        self.P = stages
        self.costs = costs
        self.memory_cap = memory_cap
        self.options = options
        self.policy = policy
        self.assignment = assignment
        expected = pipelines * microbatches * stages
        if len(assignment) != expected:
            raise ValueError(f"assignment covers {len(assignment)} of {expected} (home, mb, stage) triples")
        self.workers: list[Worker] = sorted({(p, s) for (_h, _k, s), p in assignment.items()})
        self.index = {w: i for i, w in enumerate(self.workers)}
        n = len(self.workers)
        self.stage_of = [w[1] for w in self.workers]
        self.dur = {
            kind: [costs.op_duration(kind, w) for w in self.workers]
            for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
        }
        # the runner (worker index) of every (h, k, s)
        self.runner: dict[tuple[int, int, int], int] = {
            (h, k, s): self.index[(p, s)] for (h, k, s), p in assignment.items()
        }
        # forward order key per (h, k, s): by index k, then home (optionally own pipeline first)
        self.f_key: dict[tuple[int, int, int], tuple] = {}
        for (h, k, s), p in assignment.items():
            self.f_key[(h, k, s)] = (k, 0 if (policy.own_first and h == p) else 1, h)
        self.n_mbs = [0] * n
        for key in assignment:
            self.n_mbs[self.runner[key]] += 1
        self.limit = [max(1, limit(w)) for w in self.workers]
        self.heavy = [count > microbatches for count in self.n_mbs]
        if policy.heavy_warmup:
            for wi, count in enumerate(self.n_mbs):
                if count > microbatches:
                    self.limit[wi] = max(self.limit[wi], memory_cap)
        self.ops: list[list[Op]] = [[] for _ in range(n)]
        self.free_at = [0.0] * n
        self.counts = [[0, 0, 0] for _ in range(n)]  # F, B, W placed
        # per worker: pending arrivals (time, seq, kind, h, k) and ready heaps per kind
        self.arrivals: list[list] = [[] for _ in range(n)]
        self.ready_f: list[list] = [[] for _ in range(n)]
        self.ready_b: list[list] = [[] for _ in range(n)]
        self.ready_w: list[list] = [[] for _ in range(n)]
        self.f_seq: dict[tuple[int, int, int], int] = {}  # order in which F ran on its worker
        self.f_end: dict[tuple[int, int, int], float] = {}
        self.events: list = []
        self.counter = itertools.count()

    # -- event plumbing -------------------------------------------------------------------
    def _arrive(self, wi: int, time: float, kind: str, h: int, k: int) -> None:
        seq = next(self.counter)
        heapq.heappush(self.arrivals[wi], (time, seq, kind, h, k))
        if time >= self.free_at[wi]:  # a busy worker looks at its arrivals when it becomes free
            heapq.heappush(self.events, (time, seq, wi))

    def _wake(self, wi: int, time: float) -> None:
        heapq.heappush(self.events, (time, next(self.counter), wi))

    def run(self) -> dict[Worker, list[Op]]:
        for (h, k, s), wi in self.runner.items():
            if s == 0:
                heapq.heappush(self.ready_f[wi], (self.f_key[(h, k, s)], h, k))
        for wi in range(len(self.workers)):
            self._wake(wi, 0.0)
        total = 3 * sum(self.n_mbs)
        scheduled = 0
        events = self.events
        while events:
            t, _, wi = heapq.heappop(events)
            if self.free_at[wi] > t:
                continue
            # several events of one worker at the same time: decide once
            scheduled += self._decide(wi, t)
        if scheduled != total:
            raise ValueError(
                f"list scheduler: only {scheduled} of {total} ops could be placed "
                "(cyclic dependencies or memory cap too small)"
            )
        self._place_steps()
        return {w: self.ops[i] for i, w in enumerate(self.workers)}

    def _decide(self, wi: int, t: float) -> int:
        arrivals = self.arrivals[wi]
        s = self.stage_of[wi]
        while arrivals and arrivals[0][0] <= t:
            _, _, kind, h, k = heapq.heappop(arrivals)
            if kind == FORWARD:
                heapq.heappush(self.ready_f[wi], (self.f_key[(h, k, s)], h, k))
            elif kind == BACKWARD_INPUT:
                heapq.heappush(self.ready_b[wi], (self.f_seq[(h, k, s)], h, k))
            else:
                heapq.heappush(self.ready_w[wi], (next(self.counter), h, k))
        nf, nb, nw = self.counts[wi]
        ready_f, ready_b, ready_w = self.ready_f[wi], self.ready_b[wi], self.ready_w[wi]
        policy = self.policy
        decoupled = self.options.decoupled
        f_warm = nf - nb < self.limit[wi]
        f_mem = nf - nw < self.memory_cap
        f_ok = bool(ready_f) and f_warm and f_mem
        choice = None
        if decoupled and ready_w and policy.unblock_memory and ready_f and f_warm and not f_mem:
            choice = BACKWARD_WEIGHT
        elif f_ok and (
            policy.forward_first
            or (policy.forward_first_stage0 and s == 0)
            or (policy.heavy_forward_first and self.heavy[wi])
        ):
            choice = FORWARD
        elif ready_b:
            choice = BACKWARD_INPUT
        elif f_ok:
            choice = FORWARD
        elif decoupled and ready_w:
            choice = BACKWARD_WEIGHT
            if policy.w_lookahead and arrivals:
                end = t + self.dur[BACKWARD_WEIGHT][wi]
                for time, _, kind, _h, _k in arrivals:
                    if time < end and (kind == BACKWARD_INPUT or (kind == FORWARD and f_warm and f_mem)):
                        return 0  # wait for it; its arrival event wakes us
        if choice is None:
            return 0
        if choice == FORWARD:
            _, h, k = heapq.heappop(ready_f)
        elif choice == BACKWARD_INPUT:
            _, h, k = heapq.heappop(ready_b)
        else:
            _, h, k = heapq.heappop(ready_w)
        placed = self._place(wi, choice, h, k, t)
        if choice == BACKWARD_INPUT and not decoupled:
            placed += self._place(wi, BACKWARD_WEIGHT, h, k, self.free_at[wi])
        return placed

    def _place(self, wi: int, kind: str, h: int, k: int, start: float) -> int:
        s = self.stage_of[wi]
        end = start + self.dur[kind][wi]
        self.ops[wi].append(Op(kind, h, k, s, start, end))
        self.free_at[wi] = end
        counts = self.counts[wi]
        comm = self.costs.comm
        last = self.P - 1
        if kind == FORWARD:
            counts[0] += 1
            key = (h, k, s)
            self.f_seq[key] = counts[0]
            self.f_end[key] = end
            if s < last:
                self._arrive(self.runner[(h, k, s + 1)], end + comm, FORWARD, h, k)
            else:
                self._arrive(wi, end, BACKWARD_INPUT, h, k)
        elif kind == BACKWARD_INPUT:
            counts[1] += 1
            if self.options.decoupled:
                self._arrive(wi, end, BACKWARD_WEIGHT, h, k)
            else:
                self._send_grad(h, k, s, end + self.dur[BACKWARD_WEIGHT][wi])
        else:
            counts[2] += 1
        if kind == BACKWARD_INPUT and self.options.decoupled:
            self._send_grad(h, k, s, end)
        self._wake(wi, end)
        return 1

    def _send_grad(self, h: int, k: int, s: int, end: float) -> None:
        """The input grad of (h, k, s) is sent to the runner of (h, k, s - 1)."""
        if s == 0:
            return
        key = (h, k, s - 1)
        prev = self.runner[key]
        # F(h, k, s - 1) has ended: F(h, k, s) needed its output
        self._arrive(prev, max(end + self.costs.comm, self.f_end[key]), BACKWARD_INPUT, h, k)

    def _place_steps(self) -> None:
        last_w: dict[int, float] = {}
        for wi, s in enumerate(self.stage_of):
            last_w[s] = max(last_w.get(s, 0.0), self.free_at[wi])
        everything_done = max(last_w.values(), default=0.0)
        for wi, s in enumerate(self.stage_of):
            start = last_w[s] if self.options.staggered else everything_done
            self.ops[wi].append(Op(STEP, -1, -1, s, start, start + self.costs.step))
