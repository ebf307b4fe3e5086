"""Planner benchmark: heuristic and MILP against the lower bound, planner speed, cache hits, ablation.

Grid: D in {2, 3, 4, 8}, P in {4, 8}, m in {P, 2P, 4P}; per topology the failure cases of
:func:`failure_cases` (no failure, k failures in one stage for k = 1..D-1, and a split over two
stages). Each row: the lower bound, the heuristic's and the MILP's iteration time / lower bound and
solve times, and the ablation's steady-state period / lower bound for
(a) re-routing alone: fused backward + synchronous step, (b) + decoupled backprop (B/W split),
(c) + staggered step (full ReCycle), under unit costs with a step (all-reduce + optimizer) of
``--ablation-step`` so that the staggered step has something to hide. The MILP runs on cases with
at most ``--milp-max-ops`` F/B/W ops (3 D P m); above that the row says it was skipped. When the
heuristic already meets the lower bound the MILP returns at once (gap 0).

    python bench/planner.py [--quick] [--time-limit 5] [--milp-max-ops 400] [--no-milp]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lower_bound import lower_bound
from ds_recycle.planner.milp import available_solver, plan_milp
from ds_recycle.planner.plan import CostModel, Plan, Worker
from ds_recycle.planner.validator import validate
from ds_recycle.sim.simulator import simulate

ABLATION = (
    ("reroute only (fused B+W, sync step)", ScheduleOptions(decoupled=False, staggered=False)),
    ("+ decoupled backprop", ScheduleOptions(decoupled=True, staggered=False)),
    ("+ staggered step (ReCycle)", ScheduleOptions(decoupled=True, staggered=True)),
)


@dataclass
class Row:
    D: int
    P: int
    m: int
    failed: tuple[Worker, ...]
    lower_bound: float
    heuristic: Plan
    milp: Plan | None
    milp_note: str
    ablation: list[tuple[float, float]] = field(default_factory=list)
    """(iteration time / LB, steady-state period / LB) per ABLATION variant."""

    @property
    def best_ratio(self) -> float:
        ratios = [self.heuristic.ratio] + ([self.milp.ratio] if self.milp is not None else [])
        return min(ratios)


def failure_cases(D: int, P: int) -> list[tuple[Worker, ...]]:
    """No failure; k = 1..D-1 failures in one stage (pipelines 0..k-1, stage k mod P); and
    max(2, D-1) failures split over stages 0 and P-1 (first half from pipeline 0 up, the rest from
    pipeline D-1 down), so every stage keeps a survivor."""
    cases: list[tuple[Worker, ...]] = [()]
    for k in range(1, D):
        stage = k % P
        cases.append(tuple((p, stage) for p in range(k)))
    total = max(2, D - 1)
    first = (total + 1) // 2
    split = [(p, 0) for p in range(first)] + [(D - 1 - i, P - 1) for i in range(total - first)]
    cases.append(tuple(sorted(split)))
    return cases


def topologies(quick: bool) -> list[tuple[int, int, int]]:
    if quick:
        return [(D, 4, m) for D in (2, 3) for m in (4, 8)]
    return [(D, P, m) for D in (2, 3, 4, 8) for P in (4, 8) for m in (P, 2 * P, 4 * P)]


def run_case(D: int, P: int, m: int, failed: tuple[Worker, ...], args: argparse.Namespace) -> Row:
    heuristic = plan_heuristic(D, P, m, failed)
    validate(heuristic)
    milp, note = None, ""
    ops = 3 * D * P * m
    if args.no_milp:
        note = "skipped (--no-milp)"
    elif ops > args.milp_max_ops:
        note = f"skipped ({ops} ops > --milp-max-ops {args.milp_max_ops})"
    else:
        milp = plan_milp(D, P, m, failed, time_limit=args.time_limit, warm_start=heuristic)
        validate(milp)
        if milp.iteration_time > heuristic.iteration_time + 1e-9:
            raise AssertionError(f"MILP worse than its warm start on D={D} P={P} m={m} failed={failed}")
    row = Row(D, P, m, failed, heuristic.lower_bound, heuristic, milp, note)
    costs = CostModel.uniform(P, step=args.ablation_step)
    bound = lower_bound(D, P, m, failed, costs)
    for _name, options in ABLATION:
        plan = plan_heuristic(D, P, m, failed, costs=costs, options=options)
        validate(plan)
        period = simulate(plan, iterations=4).steady_state_period
        row.ablation.append((plan.iteration_time / bound, period / bound))
    return row


def format_row(row: Row) -> str:
    failed = " ".join(f"{p}:{s}" for p, s in row.failed) or "-"
    h = row.heuristic
    if row.milp is not None:
        gap = f"{100 * row.milp.gap:5.1f}%" if row.milp.gap is not None else "   n/a"
        milp = f"{row.milp.ratio:6.3f} {row.milp.solve_seconds:6.2f}s {gap}"
    else:
        milp = f"{'-':>6} {'-':>7} {'-':>6}"
    abl = " ".join(f"{period:5.3f}" for _it, period in row.ablation)
    line = (
        f"{row.D:>2} {row.P:>2} {row.m:>3} {failed:<24} {row.lower_bound:7.1f} "
        f"{h.ratio:6.3f} {h.solve_seconds:6.3f}s  {milp}  {row.best_ratio:6.3f}  {abl}"
    )
    return line + (f"  MILP {row.milp_note}" if row.milp_note and not row.milp_note.startswith("skipped (--") else "")


HEADER = (
    f"{'D':>2} {'P':>2} {'m':>3} {'failed (p:s)':<24} {'LB':>7} "
    f"{'heur':>6} {'time':>7}  {'milp':>6} {'time':>7} {'gap':>6}  {'best':>6}  "
    f"{'abl-a':>5} {'abl-b':>5} {'abl-c':>5}"
)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def cache_hit_seconds(repeats: int = 200) -> tuple[float, float, float, float]:
    """Seconds of cache hits for D=8 P=8 m=32 with two failures at stage 3: (median repeated hit on
    the cached labels, median repeated hit on a relabelled set, median and max of the first hit of
    each of the 27 other relabellings, which must map every op to the caller's labels)."""
    cache = PlanCache()
    cache.get_or_plan(8, 8, 32, [(0, 3), (1, 3)])
    same, relabelled = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        plan = cache.get(8, 8, 32, [(0, 3), (1, 3)])
        same.append(time.perf_counter() - t)
        t = time.perf_counter()
        plan = cache.get(8, 8, 32, [(5, 3), (6, 3)])
        relabelled.append(time.perf_counter() - t)
        assert plan is not None
    first = []
    for a, b in itertools.combinations(range(8), 2):
        if (a, b) in ((0, 1), (5, 6)):
            continue
        t = time.perf_counter()
        plan = cache.get(8, 8, 32, [(a, 3), (b, 3)])
        first.append(time.perf_counter() - t)
        assert plan is not None and plan.failed == ((a, 3), (b, 3))
    return statistics.median(same), statistics.median(relabelled), statistics.median(first), max(first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small topologies only")
    parser.add_argument("--time-limit", type=float, default=5.0, help="MILP time limit per case (s)")
    parser.add_argument("--milp-max-ops", type=int, default=400, help="skip the MILP above this many F/B/W ops")
    parser.add_argument("--no-milp", action="store_true")
    parser.add_argument(
        "--ablation-step", type=float, default=1.0, help="duration of S (all-reduce + optimizer) in the ablation"
    )
    args = parser.parse_args(argv)

    began = time.perf_counter()
    print(HEADER)
    print("heur/milp: iteration time / lower bound (unit F=B=W costs, no step cost);")
    print(f"abl-*: steady-state period / lower bound with unit F=B=W and step {args.ablation_step:g}, for")
    for name, _options in ABLATION:
        print(f"  abl-{'abc'[ABLATION.index((name, _options))]}: {name}")
    rows: list[Row] = []
    for D, P, m in topologies(args.quick):
        for failed in failure_cases(D, P):
            row = run_case(D, P, m, failed, args)
            rows.append(row)
            print(format_row(row), flush=True)

    best = [r.best_ratio for r in rows]
    heur = [r.heuristic.ratio for r in rows]
    milp_rows = [r for r in rows if r.milp is not None]
    improved = [r for r in milp_rows if r.milp.iteration_time < r.heuristic.iteration_time - 1e-9]
    worst = max(rows, key=lambda r: r.best_ratio)
    print()
    print("== summary ==")
    print(
        f"cases: {len(rows)}; MILP run on {len(milp_rows)} ({available_solver()}, time limit {args.time_limit:g} s), "
        f"improved {len(improved)}"
    )
    print(
        f"best of heuristic and MILP: geometric mean ratio {geomean(best):.4f}, worst {max(best):.4f} "
        f"(D={worst.D} P={worst.P} m={worst.m} failed {list(worst.failed)})"
    )
    print(f"heuristic alone:            geometric mean ratio {geomean(heur):.4f}, worst {max(heur):.4f}")
    big = [r for r in rows if (r.D, r.P, r.m) == (8, 8, 32)]
    if big:
        times = [r.heuristic.solve_seconds for r in big]
        print(
            f"heuristic time D=8 P=8 m=32: max {max(times):.3f} s, mean {statistics.mean(times):.3f} s "
            f"over {len(big)} failure sets"
        )
    else:
        t = time.perf_counter()
        plan_heuristic(8, 8, 32, [(0, 3)])
        print(f"heuristic time D=8 P=8 m=32 (one failure): {time.perf_counter() - t:.3f} s")
    same, relabelled, first, first_max = cache_hit_seconds()
    print(
        f"cache hit (D=8 P=8 m=32): {1000 * same:.3f} ms same failure set, {1000 * relabelled:.3f} ms relabelled "
        f"(repeat); first hit of a new relabelling {1000 * first:.2f} ms median, {1000 * first_max:.2f} ms max"
    )
    print()
    print(
        f"== ablation (same cases, step = {args.ablation_step:g}; geometric mean / worst over cases, "
        "relative to the lower bound) =="
    )
    for i, (name, _options) in enumerate(ABLATION):
        its = [r.ablation[i][0] for r in rows]
        periods = [r.ablation[i][1] for r in rows]
        print(
            f"{name:<38} iteration {geomean(its):.4f} / {max(its):.4f}   "
            f"steady-state period {geomean(periods):.4f} / {max(periods):.4f}"
        )
    base = [r.ablation[0][1] for r in rows]
    for i, (name, _options) in enumerate(ABLATION[1:], start=1):
        speedup = geomean([b / r.ablation[i][1] for b, r in zip(base, rows, strict=True)])
        print(f"steady-state speed-up of '{name}' over re-routing alone: {speedup:.4f}x")
    print(f"bench wall time {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
