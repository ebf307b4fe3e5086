"""ReCycle's adaptive pipelining in the real engine: iteration time with workers gone, measured
against the planner's prediction, and against re-routing alone.

Under timing emulation (every F, B and W padded to --ms milliseconds, so that this host's few
cores stand in for eight devices), one ``ds-recycle launch --respawn`` job of pp=4 x dp=2, m=8
runs three phases:

1. fault-free;
2. one worker of stage 1 gone: it gets SIGTERM (a leave: it finishes its iteration and the
   survivors switch to the adapted plan at the next boundary); its respawn waits behind a gate;
3. it re-joins (the survivors wait at a boundary until the launcher accepts the join), then one
   worker of stage 0 and one of stage 3 (of the other pipeline) get SIGTERM.

The same job runs twice: with ReCycle's mechanisms (decoupled backprop, staggered optimizer step)
and with ``decoupled_backprop: false, staggered_optimizer: false`` (re-routing alone). For each
failure set it prints the measured median iteration time (over the iterations of that epoch after
the switch iteration, excluding the switch iteration and the epoch's last one), the plan's
prediction and lower bound, measured / predicted (goal: at most 1.10) and the throughput kept
relative to the same engine's fault-free phase; then the ratio re-routing alone / ReCycle.

An iteration's time is the period of the whole job: the last rank's end of iteration i minus the
last rank's end of iteration i - 1 (wall clock of one host).

The ranks run ds_recycle/testing/worker.py with ``--gate --timings``.

``--rebalance`` runs instead the migration rows (issue 20): pp=2 x dp=4, m=8, two workers of stage
1 SIGKILLed and given up (``--max-restarts 0``), so that stage 1 keeps 2 of its 4 workers. One
launch with ``--rebalance off`` (the grid stays unbalanced), one with ``--rebalance migrate`` (a
stage-0 worker moves into a dead stage-1 slot: 3 and 3). It prints each epoch's measured iteration
time against the planner's and the fault-free phase, the balanced / unbalanced throughput, and
the move's cost: from the move's acceptance to the joiner's first iteration, and the time the
transition's iterations took beyond the balanced rate.

    .venv/bin/python bench/failures.py [--ms 40] [--iterations 12] [--json out.json] [--smoke] [--rebalance]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ds_recycle.testing.jobs import Job, slot
from ds_recycle.testing.tiny import ds_config

PP, DP, M = 4, 2, 8
STAGE_1 = [(0, 1)]
"""Worker (pipeline, stage) that leaves in phase 2."""
STAGES_0_AND_3 = [(0, 0), (1, 3)]
"""Workers that leave in phase 3."""
WARMUP = 2
"""Iterations of the fault-free phase not measured (first iterations: allocations, caches)."""
MODES = {
    "ReCycle": {},
    "re-routing alone": {"decoupled_backprop": False, "staggered_optimizer": False},
}


@dataclass
class Row:
    mode: str
    failed: list[tuple[int, int]]
    epoch: int
    first_iteration: int
    iterations: list[int]
    """The iterations measured."""
    seconds: list[float]
    predicted_ms: float
    lower_bound_ms: float
    fault_free_predicted_ms: float
    rerouted: int
    kept: float = float("nan")
    """Measured throughput relative to this mode's fault-free phase."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.seconds) * 1e3

    @property
    def measured_over_predicted(self) -> float:
        return self.median_ms / self.predicted_ms


@dataclass
class ModeResult:
    mode: str
    rows: list[Row] = field(default_factory=list)
    wall_seconds: float = 0.0

    def row(self, failed: list[tuple[int, int]]) -> Row | None:
        return next((r for r in self.rows if sorted(r.failed) == sorted(failed)), None)


def run_mode(
    mode: str, overrides: dict, ms: float, iterations: int, steps: int, workdir: Path, timeout: float
) -> ModeResult:
    """One launch of ``steps`` iterations with the three phases; returns one row per epoch with
    enough iterations."""
    began = time.time()
    config = ds_config(M, 0.0, {"enabled": True, "emulate_timing": {"F": ms, "B": ms, "W": ms}, **overrides})
    tmp = workdir / mode.replace(" ", "_")
    job = Job(tmp, PP, DP, steps, config, "sgd", respawn=True, timeout=timeout, worker_args=["--gate", "--timings"])
    for s in range(PP * DP):
        (job.out / f"gate{s}").write_text("")  # respawns wait until the benchmark lets them in
    leaver = [slot(DP, p, s) for p, s in STAGE_1]
    pair = [slot(DP, p, s) for p, s in STAGES_0_AND_3]
    watch = slot(DP, 1, 1)  # a worker that never leaves
    job.start()
    try:
        # Phase 1 -> 2: the stage-1 worker leaves after WARMUP + iterations + 1 fault-free iterations.
        at = WARMUP + iterations + 1
        job.wait_until(lambda: job.progress(watch) >= at, f"iteration {at}", timeout=600)
        job.signal_at(leaver, at, signal.SIGTERM, watch=watch)
        job.wait_for_event("exited", timeout=120, slot=leaver[0], code=0)
        switched = job.progress(watch)
        # Phase 2 -> re-join: hold the survivors after `iterations` + 2 more, let the respawn in.
        hold = switched + iterations + 2
        job.hold(hold)
        job.wait_until(lambda: job.progress(watch) >= hold, f"iteration {hold}", timeout=600)
        (job.out / f"gate{leaver[0]}").unlink()
        job.wait_for_event("accepted", timeout=300, kind="join", slot=leaver[0])
        job.hold(None)
        job.wait_until(lambda: job.progress(leaver[0]) > hold, "the re-joined worker to train", timeout=300)
        # Phase 3: two fault-free iterations after the re-join, then stage 0 and stage 3 leave.
        job.signal_at(pair, job.progress(watch) + 2, signal.SIGTERM, watch=watch)
        left = job.progress(watch)
        if steps - left < iterations + 4:
            raise AssertionError(f"only {steps - left} iterations left for phase 3; raise the step count")
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    if code != 0:
        raise SystemExit(f"{mode}: the launcher exited {code}\n{job.log_tail()}")
    result = ModeResult(mode, measure(mode, job.out, steps), time.time() - began)
    fault_free = result.row([])
    for row in result.rows:
        row.kept = fault_free.median_ms / row.median_ms if fault_free else float("nan")
    return result


REBALANCE_PP, REBALANCE_DP = 2, 4
LOST = [(2, 1), (3, 1)]
"""Two workers of stage 1, killed and given up in the migration rows."""


def run_rebalance(rebalance: str, ms: float, iterations: int, workdir: Path, timeout: float) -> dict:
    """One launch: fault-free, then LOST SIGKILLed at their first F of one iteration and given up;
    with ``migrate``, measured until after the mover's device re-joined."""
    began = time.time()
    config = ds_config(M, 0.0, {"enabled": True, "emulate_timing": {"F": ms, "B": ms, "W": ms}})
    steps = WARMUP + 3 * iterations + 12
    tmp = workdir / f"rebalance_{rebalance}"
    job = Job(tmp, REBALANCE_PP, REBALANCE_DP, steps, config, "sgd", respawn=True, timeout=timeout)
    job.worker_args = ["--timings"]
    job.launcher_args = ["--max-restarts", "0", "--rebalance", rebalance]
    at = WARMUP + iterations + 1
    lost = [slot(REBALANCE_DP, p, s) for p, s in LOST]
    job.traps = [f"{s}:F:{at}" for s in lost]
    job.start()
    try:
        for s in lost:
            job.signal_when_trapped(s)
        if rebalance == "migrate":
            job.wait_for_event("moved", timeout=300)
            job.wait_for_event("accepted", timeout=300, kind="join")
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    if code != 0:
        raise SystemExit(f"rebalance {rebalance}: the launcher exited {code}\n{job.log_tail()}")
    processes = load_processes(job.out)
    rows = measure(f"rebalance {rebalance}", job.out, steps)
    fault_free = next((r for r in rows if not r.failed), None)
    for row in rows:
        row.kept = fault_free.median_ms / row.median_ms if fault_free else float("nan")
    result = {"rebalance": rebalance, "rows": rows, "wall_seconds": time.time() - began}
    if rebalance == "migrate":
        result.update(move_cost(job, processes, rows))
    return result


def move_cost(job: Job, processes: list[dict], rows: list[Row]) -> dict:
    """From the move's acceptance to the joiner's first iteration (wall seconds), and the extra
    seconds the iterations from the failure to the balanced epoch took beyond its median."""
    accepted = job.events.select("accepted", kind="move")[0]["time"]
    changes = {c["epoch"]: c for process in processes for c in process["changes"]}
    joined = next(c for _, c in sorted(changes.items()) if c["joined"])
    failed_first = min(c["iteration"] for c in changes.values() if c["failed"])
    balanced = next(r for r in rows if r.epoch == joined["epoch"])
    ends = iteration_ends(processes)
    span = [i for i in range(failed_first, joined["iteration"] + 1) if i in ends and i - 1 in ends]
    extra = sum(ends[i] - ends[i - 1] for i in span) - len(span) * balanced.median_ms / 1e3
    return {
        "accepted_to_joined_s": joined["time"] - accepted,
        "transition_iterations": len(span),
        "extra_seconds": extra,
        "balanced_ms": balanced.median_ms,
    }


def report_rebalance(results: list[dict], args: argparse.Namespace, load_before: str) -> None:
    print(
        f"pp={REBALANCE_PP} dp={REBALANCE_DP} m={M}, F=B=W={args.ms:g} ms emulated, ds-recycle launch --max-restarts 0 "
        f"on {os.cpu_count()} cores; load average before {load_before}, after {load_average()}"
    )
    print(f"workers {describe(LOST)} SIGKILLed and given up (stage 1 keeps 2 of 4); times in ms")
    print(f"{'rebalance':10}{'gone':22}{'iters':>6}{'median':>9}{'predicted':>10}{'meas/pred':>10}{'kept':>7}")
    for result in results:
        for row in result["rows"]:
            print(
                f"{result['rebalance']:10}{describe(row.failed):22}{len(row.iterations):6d}{row.median_ms:9.1f}"
                f"{row.predicted_ms:10.1f}{row.measured_over_predicted:10.3f}{row.kept:7.3f}"
            )
    off, on = results
    unbalanced = next(r for r in off["rows"] if sorted(r.failed) == sorted(LOST))
    balanced = next(r for r in on["rows"] if r.median_ms == on["balanced_ms"])
    print(
        f"rebalanced / unbalanced throughput: measured {unbalanced.median_ms / balanced.median_ms:.3f}, "
        f"predicted {unbalanced.predicted_ms / balanced.predicted_ms:.3f}; kept of fault-free: unbalanced "
        f"{unbalanced.kept:.3f}, rebalanced {balanced.kept:.3f}"
    )
    print(
        f"the move: accepted -> joiner training {on['accepted_to_joined_s']:.2f} s; the {on['transition_iterations']} "
        f"iterations from the failure to the balanced epoch took {on['extra_seconds']:.2f} s more than at the "
        f"balanced rate (paid back after {on['extra_seconds'] * 1e3 / (unbalanced.median_ms - balanced.median_ms):.1f} "
        "balanced iterations)"
    )
    print(", ".join(f"wall time with --rebalance {r['rebalance']}: {r['wall_seconds']:.0f} s" for r in results))


def load_processes(out: Path) -> list[dict]:
    """Every process's last saved state: final records, else what it saved after its last iteration."""
    final = {p.name: torch.load(p, weights_only=False) for p in out.glob("[0-9]*.pt")}
    processes = []
    for path in sorted(out.glob("ledger*.pt")):
        name = path.name[len("ledger") :]
        processes.append(final.get(name) or torch.load(path, weights_only=False))
    return processes


def iteration_ends(processes: list[dict]) -> dict[int, float]:
    """The job's period: the last end of iteration i over every process that ran it."""
    ends: dict[int, float] = {}
    for process in processes:
        for call in process["calls"]:
            ends[call["done"] - 1] = max(ends.get(call["done"] - 1, 0.0), call["end"])
    return ends


def measure(mode: str, out: Path, steps: int) -> list[Row]:
    processes = load_processes(out)
    ends = iteration_ends(processes)
    # Epochs: the first iteration and the plan each ran, from every process's changes and calls.
    epochs: dict[int, dict] = {}
    for process in processes:
        for call in process["calls"]:
            if "plan" in call and call["epoch"] not in epochs:
                epochs[call["epoch"]] = {"plan": call["plan"], "first": None}
        for change in process["changes"]:
            epochs.setdefault(change["epoch"], {"plan": change["plan"], "first": None})["first"] = change["iteration"]
    epochs[0]["first"] = 0
    order = sorted(epochs)
    rows = []
    for index, epoch in enumerate(order):
        first = epochs[epoch]["first"]
        end = epochs[order[index + 1]]["first"] if index + 1 < len(order) else steps
        skip = WARMUP if epoch == 0 else 1  # the switch iteration (or warm-up) ...
        last = end - 1 if index + 1 < len(order) else end  # ... and the epoch's last one (a hold)
        measured = [i for i in range(first + skip, last) if i in ends and i - 1 in ends]
        if len(measured) < 3:
            continue
        plan = epochs[epoch]["plan"]
        rows.append(
            Row(
                mode=mode,
                failed=sorted(tuple(w) for w in plan["failed"]),
                epoch=epoch,
                first_iteration=first,
                iterations=measured,
                seconds=[ends[i] - ends[i - 1] for i in measured],
                predicted_ms=plan["predicted_iteration_time"],
                lower_bound_ms=plan["lower_bound"],
                fault_free_predicted_ms=plan["fault_free_iteration_time"],
                rerouted=plan["rerouted_microbatches"],
            )
        )
    # A phase re-measured (fault-free after the re-join) keeps its first, longer epoch.
    unique: dict[tuple, Row] = {}
    for row in rows:
        key = tuple(row.failed)
        if key not in unique or len(row.iterations) > len(unique[key].iterations):
            unique[key] = row
    return sorted(unique.values(), key=lambda r: r.epoch)


def describe(failed: list[tuple[int, int]]) -> str:
    if not failed:
        return "fault-free"
    return " ".join(f"({p},{s})" for p, s in failed)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", type=float, default=40.0, help="emulated duration of each F, B and W")
    parser.add_argument("--iterations", type=int, default=12, help="iterations measured per phase (about)")
    parser.add_argument("--timeout", type=float, default=900.0, help="bound on each launch, seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the jobs' files in this directory")
    parser.add_argument("--smoke", action="store_true", help="ReCycle only, few short iterations (for the test suite)")
    parser.add_argument("--rebalance", action="store_true", help="the migration rows instead (see the module doc)")
    args = parser.parse_args()
    modes, steps = dict(MODES), 3 * args.iterations + 20
    if args.smoke:
        args.ms, args.iterations = 5.0, 3
        modes, steps = {"ReCycle": MODES["ReCycle"]}, 3 * args.iterations + 40
    load_before = load_average()
    workdir = Path(tempfile.mkdtemp(prefix="ds_recycle_failures_")) if args.keep is None else args.keep
    if args.rebalance:
        try:
            runs = [run_rebalance(r, args.ms, args.iterations, workdir, args.timeout) for r in ("off", "migrate")]
        finally:
            if args.keep is None:
                shutil.rmtree(workdir, ignore_errors=True)
        report_rebalance(runs, args, load_before)
        return
    try:
        results = [
            run_mode(mode, o, args.ms, args.iterations, steps, workdir, args.timeout) for mode, o in modes.items()
        ]
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report(results, args, load_before)


def compare_modes(recycle: ModeResult, alone: ModeResult) -> None:
    print("re-routing alone / ReCycle (iteration time; > 1: ReCycle's mechanisms pay off):")
    for failed in ([], STAGE_1, STAGES_0_AND_3):
        ours, theirs = recycle.row(failed), alone.row(failed)
        if ours is None or theirs is None:
            print(f"  {describe(failed):12} not measured (an epoch had too few iterations)")
            continue
        print(
            f"  {describe(failed):12} measured {theirs.median_ms / ours.median_ms:.3f}, "
            f"predicted {theirs.predicted_ms / ours.predicted_ms:.3f}"
        )


def report(results: list[ModeResult], args: argparse.Namespace, load_before: str) -> None:
    print(
        f"pp={PP} dp={DP} m={M}, F=B=W={args.ms:g} ms emulated, ds-recycle launch on {os.cpu_count()} cores; "
        f"load average before {load_before}, after {load_average()}"
    )
    print(
        "workers gone by SIGTERM (leave at a boundary); (p,s) = (pipeline, stage); times in ms; "
        "kept = throughput / same mode's fault-free"
    )
    header = (
        f"{'mode':17}{'gone':12}{'iters':>6}{'median':>9}{'min':>9}{'predicted':>10}{'bound':>8}"
        f"{'meas/pred':>10}{'kept':>7}{'kept pred':>10}{'rerouted F':>11}"
    )
    print(header)
    for result in results:
        for row in result.rows:
            kept_predicted = row.fault_free_predicted_ms / row.predicted_ms
            print(
                f"{row.mode:17}{describe(row.failed):12}{len(row.iterations):6d}{row.median_ms:9.1f}"
                f"{row.min_ms:9.1f}{row.predicted_ms:10.1f}{row.lower_bound_ms:8.1f}"
                f"{row.measured_over_predicted:10.3f}{row.kept:7.3f}{kept_predicted:10.3f}{row.rerouted:11d}"
            )
    if len(results) == 2:
        compare_modes(*results)
    worst = max(row.measured_over_predicted for result in results for row in result.rows)
    verdict = "met" if worst <= 1.10 else "NOT met"
    print(f"worst measured/predicted {worst:.3f} (goal <= 1.10: {verdict}); wall time per launch: ", end="")
    print(", ".join(f"{r.mode} {r.wall_seconds:.0f} s" for r in results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "ms": args.ms,
                    "modes": [
                        {"mode": r.mode, "wall_seconds": r.wall_seconds, "rows": [asdict(row) for row in r.rows]}
                        for r in results
                    ],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
