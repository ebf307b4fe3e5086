"""Plans from measured costs, and stragglers routed around, in the real engine (issue 18).

Timing emulation: every F, B and W is padded to a duration (``recycle.emulate_timing``), so that
this host's few cores stand in for P x D devices; ``slowdown`` pads every op of one worker to a
factor of it (a straggler). Two parts:

1. **Stragglers** (one static launch of ``ds_recycle.testing.engine_runs``: every run in the same
   processes, one after the other, from one seed): uniform stages (F = B = W = --ms), worker
   (1, 1) slowed to 1.5x and 2x. Per run the median iteration time (the slowest rank's
   ``train_batch``), after the warm-up; with straggler handling, after the iteration that
   switched plans. Throughput against the same engine's fault-free run, for stock DeepSpeed
   (``recycle.enabled: false``: DeepSpeed's schedule, padded the same way), ReCycle with
   ``stragglers: false``, and ReCycle (stragglers on, the default), and the iteration at which
   the straggler was planned around.
2. **Heterogeneous stages** (``ds-recycle launch`` jobs of ds_recycle/testing/worker.py): the first
   stage 1.2x and the last 1.6x a middle one, W = 0.6 B. The planner is told unit costs before
   anything is measured (``emulate_timing.planner_costs: unit``); one job measures the profile
   (the default ``recycle.profile``), the other plans with unit costs throughout
   (``profile: false``). Each job runs fault-free, then one middle-stage worker leaves (SIGTERM,
   a leave at the next boundary), then a second one. Per failure set: the median iteration time
   (the period of the whole job), measured / predicted (profiled plans only: a unit-cost plan
   predicts in units) and throughput against the job's fault-free phase. The one-failure row
   of the profiled job is the paper's claim that a failure's extra work can fit into the bubbles.

The last line: ``straggler 2x: with handling X.XX of fault-free, without Y.YY, stock Z.ZZ;
heterogeneous: measured/predicted W.WW`` (W: the worst over the profiled job's failure sets).

    .venv/bin/python bench/measured_costs.py [--pp 4] [--dp 4] [--ms 30] [--iterations 8] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import ds_recycle.testing
from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.jobs import Job, slot
from ds_recycle.testing.tiny import ds_config

RUNS_SCRIPT = Path(ds_recycle.testing.__file__).with_name("engine_runs.py")
STRAGGLER = (1, 1)
WARMUP = 3
"""Iterations of every run not measured (allocations, caches, the profile's warm-up)."""
CLIP = 1.0


@dataclass
class Sizes:
    pp: int
    dp: int
    m: int
    ms: float
    iterations: int
    factors: tuple[float, ...]
    leaves: list[tuple[int, int]]


def straggler_runs(sizes: Sizes) -> list[dict]:
    uniform = {"F": sizes.ms, "B": sizes.ms, "W": sizes.ms}
    steps = WARMUP + 4 + sizes.iterations
    runs = []
    for factor in (None, *sizes.factors):
        timing = dict(uniform)
        if factor is not None:
            timing["slowdown"] = [[*STRAGGLER, factor]]
        for mode, recycle in (
            ("stock", {"enabled": False}),
            ("ReCycle, no handling", {"enabled": True, "stragglers": False}),
            ("ReCycle", {"enabled": True}),
        ):
            if factor is None and mode == "ReCycle, no handling":
                continue  # the same run as ReCycle's without a straggler
            name = f"{mode} x{factor or 1:g}".replace(" ", "_").replace(",", "")
            config = ds_config(sizes.m, CLIP, {**recycle, "emulate_timing": timing})
            runs.append({"name": name, "mode": mode, "factor": factor or 1.0, "config": config, "steps": steps})
    return runs


def run_stragglers(sizes: Sizes, workdir: Path) -> list[dict]:
    runs = straggler_runs(sizes)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "runs.json").write_text(json.dumps(runs))
    argv = [str(RUNS_SCRIPT), "--pp", str(sizes.pp), "--runs", str(workdir / "runs.json"), "--out", str(workdir)]
    results = launch(
        argv, sizes.pp * sizes.dp, timeout=1800, log_dir=workdir / "logs", membership=False, preload=PRELOAD_MODULES
    )
    for r in results:
        if not r.ok:
            sys.stderr.write(r.log[-4000:])
            raise SystemExit(f"stragglers: rank {r.rank} failed ({r.returncode})")
    rows = []
    for run in runs:
        dumps = [torch.load(workdir / run["name"] / f"rank{r}.pt") for r in range(sizes.pp * sizes.dp)]
        periods = [max(times) for times in zip(*(d["seconds"] for d in dumps), strict=True)]
        changes = dumps[0].get("cost_changes", [])
        detected = next(
            (
                c["iteration"]
                for c in changes
                for s in c["changes"]
                if s["detected"] and tuple(s["worker"]) == STRAGGLER
            ),
            None,
        )
        start = WARMUP if detected is None else max(WARMUP, detected + 1)
        gives = dumps[0]["gives"][-1]
        rows.append(
            {
                **{k: run[k] for k in ("name", "mode", "factor")},
                "median_ms": statistics.median(periods[start:]) * 1e3,
                "iterations": len(periods[start:]),
                "detected": detected,
                "give": gives.get(f"{STRAGGLER[0]},{STRAGGLER[1]}", 0),
                "predicted": next((c["predicted"] for c in changes if c["iteration"] == detected), None),
            }
        )
    for row in rows:
        # ReCycle without straggler handling is ReCycle's engine: its fault-free run is ReCycle's
        engine = "stock" if row["mode"] == "stock" else "ReCycle"
        own = next(r for r in rows if r["mode"] == engine and r["factor"] == 1.0)
        row["kept"] = own["median_ms"] / row["median_ms"]
    return rows


def heterogeneous_timing(sizes: Sizes) -> dict:
    scale = [1.2 if s == 0 else 1.6 if s == sizes.pp - 1 else 1.0 for s in range(sizes.pp)]
    if sizes.pp == 1:
        scale = [1.0]
    F = [round(sizes.ms * x, 3) for x in scale]
    return {"F": F, "B": F, "W": [round(0.6 * b, 3) for b in F], "planner_costs": "unit"}


def run_heterogeneous(sizes: Sizes, profiled: bool, workdir: Path) -> list[dict]:
    recycle = {"enabled": True, "emulate_timing": heterogeneous_timing(sizes)}
    if not profiled:
        recycle["profile"] = False
    phase = sizes.iterations + 3
    steps = WARMUP + 2 + phase * (len(sizes.leaves) + 1) + 4  # + a leaver's exit, which the others train through
    tmp = workdir / ("profiled" if profiled else "unit")
    job = Job(tmp, sizes.pp, sizes.dp, steps, ds_config(sizes.m, CLIP, recycle), "sgd", respawn=False, timeout=1800)
    job.worker_args = ["--timings"]
    leavers = [slot(sizes.dp, p, s) for p, s in sizes.leaves]
    watch = next(s for s in range(sizes.pp * sizes.dp) if s not in leavers)
    job.start()
    try:
        at = WARMUP + 2 + phase
        for leaver in leavers:
            job.signal_at([leaver], at, signal.SIGTERM, watch=watch)
            job.wait_for_event("exited", timeout=300, slot=leaver, code=0)
            at = job.progress(watch) + phase
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    if code != 0:
        raise SystemExit(
            f"heterogeneous ({'profiled' if profiled else 'unit'}): launcher exited {code}\n{job.log_tail()}"
        )
    return measure_epochs(tmp / "out", steps)


def measure_epochs(out: Path, steps: int) -> list[dict]:
    final = {p.name: torch.load(p, weights_only=False) for p in out.glob("[0-9]*.pt")}
    processes = [
        final.get(p.name[len("ledger") :]) or torch.load(p, weights_only=False) for p in out.glob("ledger*.pt")
    ]
    ends: dict[int, float] = {}
    epochs: dict[int, dict] = {}
    for process in processes:
        for call in process["calls"]:
            ends[call["done"] - 1] = max(ends.get(call["done"] - 1, 0.0), call["end"])
            if "plan" in call:
                epochs.setdefault(call["epoch"], {"plan": call["plan"], "first": None})
        for change in process["changes"]:
            epochs.setdefault(change["epoch"], {"plan": change["plan"], "first": None})
            epochs[change["epoch"]].update(
                first=change["iteration"], plan=change["plan"] or epochs[change["epoch"]]["plan"]
            )
            epochs[change["epoch"]].setdefault("switch_ms", []).append(change["switch_seconds"] * 1e3)
    epochs[0]["first"] = 0
    order = sorted(epochs)
    rows = []
    for index, epoch in enumerate(order):
        first = epochs[epoch]["first"]
        end = epochs[order[index + 1]]["first"] if index + 1 < len(order) else steps
        skip = WARMUP + 1 if epoch == 0 else 1
        measured = [i for i in range(first + skip, end - 1) if i in ends and i - 1 in ends]
        if len(measured) < 2:
            continue
        plan = epochs[epoch]["plan"]
        rows.append(
            {
                "failed": sorted(tuple(w) for w in plan["failed"]),
                "median_ms": statistics.median(ends[i] - ends[i - 1] for i in measured) * 1e3,
                "iterations": len(measured),
                "predicted": plan["predicted_iteration_time"],
                "fault_free_predicted": plan["fault_free_iteration_time"],
                "prefetched": bool(plan.get("prefetched")),
                "switch_ms": max(epochs[epoch].get("switch_ms", [0.0])),
            }
        )
    # the fault-free epoch's first plan predates the profile; a later epoch's summary holds the
    # fault-free plan's prediction on the costs in use then
    later = [epochs[e]["plan"]["fault_free_iteration_time"] for e in order[1:]]
    base = next((r for r in rows if not r["failed"]), None)
    if base is not None and later:
        base["predicted"] = later[0]
    for row in rows:
        row["kept"] = base["median_ms"] / row["median_ms"] if base else float("nan")
    return rows


def describe(failed) -> str:
    return " ".join(f"({p},{s})" for p, s in failed) if failed else "fault-free"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="micro-batches per pipeline and iteration")
    parser.add_argument("--ms", type=float, default=30.0, help="a middle stage's emulated F (and B; W = 0.6 B)")
    parser.add_argument("--iterations", type=int, default=8, help="iterations measured per run or phase (about)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the jobs' files in this directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true", help="2 x 2, 2x only, one leave (for the test suite)")
    args = parser.parse_args()
    if args.smoke:
        sizes = Sizes(2, 2, 4, 8.0, 3, (2.0,), [(0, 1)])
    else:
        middle = [(0, 1), (1, 2)] if args.pp >= 3 else [(0, args.pp - 1), (1, 0)]
        sizes = Sizes(args.pp, args.dp, args.m, args.ms, args.iterations, (1.5, 2.0), middle)
    workdir = Path(tempfile.mkdtemp(prefix="ds_recycle_costs_")) if args.keep is None else args.keep
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    began = time.time()
    try:
        stragglers = run_stragglers(sizes, workdir / "stragglers")
        profiled = run_heterogeneous(sizes, True, workdir)
        unit = run_heterogeneous(sizes, False, workdir)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report(sizes, stragglers, profiled, unit, load_before, time.time() - began, args.json)


def report(sizes: Sizes, stragglers: list[dict], profiled: list[dict], unit: list[dict], load: str, wall: float, out):
    print(
        f"pp={sizes.pp} dp={sizes.dp} m={sizes.m} on {os.cpu_count()} cores (load average before {load}, after "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}), {wall:.0f} s"
    )
    print(
        f"stragglers: F = B = W = {sizes.ms:g} ms emulated, worker {STRAGGLER} slowed; "
        "kept = throughput / same engine's fault-free"
    )
    print(f"{'engine':22}{'slowdown':>9}{'iters':>6}{'median ms':>10}{'kept':>7}{'detected at':>12}{'handed over':>12}")
    for row in stragglers:
        detected = "-" if row["detected"] is None else f"iter {row['detected']}"
        handed = f"{row['give']} of {sizes.m}" if row["mode"] == "ReCycle" and row["factor"] > 1 else "-"
        print(
            f"{row['mode']:22}{row['factor']:8.1f}x{row['iterations']:6d}{row['median_ms']:10.1f}{row['kept']:7.3f}"
            f"{detected:>12}{handed:>12}"
        )
    timing = heterogeneous_timing(sizes)
    print(
        f"heterogeneous stages: F {timing['F']} ms, B = F, W = 0.6 B; plans from the measured profile against plans "
        "from unit costs (predictions of unit-cost plans are in units: no measured/predicted)"
    )
    print(f"{'plans from':12}{'gone':14}{'iters':>6}{'median ms':>10}{'predicted':>10}{'meas/pred':>10}{'kept':>7}")
    for name, rows in (("profile", profiled), ("unit costs", unit)):
        for row in rows:
            ratio = f"{row['median_ms'] / row['predicted']:10.3f}" if name == "profile" else f"{'-':>10}"
            predicted = f"{row['predicted']:10.1f}" if name == "profile" else f"{'-':>10}"
            print(
                f"{name:12}{describe(row['failed']):14}{row['iterations']:6d}{row['median_ms']:10.1f}{predicted}{ratio}"
                f"{row['kept']:7.3f}"
            )
    for row in profiled:
        other = next((r for r in unit if r["failed"] == row["failed"]), None)
        if other is not None:
            ratio = other["median_ms"] / row["median_ms"]
            print(f"  {describe(row['failed']):14} unit-cost plan / profiled plan (iteration time): {ratio:.3f}")
    one = next((r for r in profiled if len(r["failed"]) == 1), None)
    if one is not None:
        print(
            f"zero degradation (one failure, D={sizes.dp}, profiled plan): {one['kept']:.3f} of fault-free throughput"
        )
    changed = [row for row in profiled if row["failed"]]
    if changed:
        hits = sum(row["prefetched"] for row in changed)
        print(
            f"plan cache: {hits} of {len(changed)} membership changes found their plan prefetched "
            "(recycle.prefetch_plans); the switch to the new epoch (groups, state, plan), slowest member: "
            + ", ".join(f"{describe(row['failed'])} {row['switch_ms']:.0f} ms" for row in changed)
        )
    if out is not None:
        out.write_text(json.dumps({"stragglers": stragglers, "profiled": profiled, "unit": unit}, indent=1))
    top = max(sizes.factors)

    def kept(mode: str) -> float:
        return next(r["kept"] for r in stragglers if r["mode"] == mode and r["factor"] == top)

    worst = max((r["median_ms"] / r["predicted"] for r in profiled), default=float("nan"))
    print(
        f"straggler {top:g}x: with handling {kept('ReCycle'):.2f} of fault-free, without "
        f"{kept('ReCycle, no handling'):.2f}, stock {kept('stock'):.2f}; heterogeneous: measured/predicted {worst:.2f}"
    )


if __name__ == "__main__":
    main()
