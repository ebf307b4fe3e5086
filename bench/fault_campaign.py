"""Randomized fault campaign: ReCycle under kills, hangs, leaves and crashes of leavers and joiners,
with re-joins, in real ``ds-recycle launch --respawn`` jobs of pp=3 x dp=3 (the tests' tiny GPT,
m=4, gradient clipping, F=B=W=8 ms emulated, ``--heartbeat-min-timeout 1``).

A seeded schedule of faults is split over a few launches (``--jobs``), so that each stays short.
Every other job trains from a map-style ``training_data`` with helper processes beside each rank
(two DataLoader workers and a forked process, as training scripts have); the others from a
provider. Each fault picks

- a kind: SIGKILL (a death, most often), SIGSTOP (a hang: detected by the stale heartbeat), SIGTERM
  (a graceful leave at the next boundary), or a crashing leaver ("SIGTERM>KILL": SIGTERM, and once
  the launcher accepted the leave, SIGKILL before the rank's boundary: it stays parked at its trap);
- where the signals go: the rank's process, or its whole process group (the rank and its helpers,
  as Slurm delivers a preemption notice or ``scancel``; each rank leads a session of its own);
- one worker, or two of different pipelines (never every worker of a stage);
- a moment: a trap (the rank parks at the first F, B or W, at the data-parallel all-reduce or right
  after its optimizer step of the iteration, so the signal lands exactly there; the second worker
  of a pair may instead be parked at the start of the survivors' recovery from the first, or once
  they all entered its epoch, before its world exists), or a
  random fraction of an iteration of wall clock after a boundary (a crashing leaver is always
  trapped);
- sometimes a crashing joiner: the first worker's respawn is let in only once the survivors wait at
  a boundary, and is SIGKILLed (its process or its group) while its join is pending (accepted, not
  yet decided). It must cost the survivors nothing; the next respawn re-joins.

A fault lands two iterations after the previous one's re-join. The survivors run a few iterations
on the adapted plan (held at a boundary: ``ds_recycle.testing.jobs.hold_degraded`` and ``rejoin``),
the launcher's respawn re-joins from a live replica, and the job goes on. The rank script is
ds_recycle/testing/worker.py with ``--trap-files --gate --timings``: traps are read from files at
every boundary, in any incarnation, respawns wait at a gate file while one exists, and every process
records its membership changes (with the engine's detection and recovery times) and when it started
and joined. The driver watches the launcher through its ``--events`` stream.

After each job, every slot's final parameters, optimizer state and losses are compared with a
fault-free run of the same job, and the F ledger of every process (killed ones included, minus the
work their recovery voided) must hold every micro-batch of every iteration exactly once per stage.
A fault counts as survived when its job exited 0 and passed both checks, the survivors ran on a plan
without its workers, the respawn brought the job back to the fault-free plan, the survivors
restarted no earlier than the iteration in flight at the first signal (lost work at most the
in-flight iteration), and a crashing joiner was published as failed while its join was pending.

Latencies (wall clock of this host; "every survivor" is the last one to get there):

- detection: the killing signal to every survivor stopped by the failure (SIGSTOP: includes the
  heartbeat timeout; a crashing leaver: from its SIGKILL);
- to the new plan: the fault's last signal to every survivor running on the plan without its
  workers; for SIGSTOP also from the coordinator's publication of the hang (the engine's
  "recovered ... ms after the failure");
- re-join: the respawned process's start, and the coordinator's acceptance of its join request, to
  every member back on the fault-free plan.

    flock /tmp/cpu.lock .venv/bin/python bench/fault_campaign.py [--faults 30] [--jobs 3] [--seed 0]
        [--optimizer sgd|adam|alternate] [--hang-timeout 1] [--json out.json] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds_recycle.testing.jobs import (
    DEGRADED_ITERATIONS,
    Job,
    M,
    assert_final_states,
    assert_ledger_exact,
    final_states,
    first_divergence,
    hold_degraded,
    job_config,
    killed_ledgers,
    rejoin,
    run_fault_free,
    slot,
    wait_until_held,
    worst_parameter_difference,
)

PP, DP = 3, 3
WORKER_ARGS = ["--trap-files", "--gate", "--timings"]
HANG_TIMEOUT = 1.0
"""--heartbeat-min-timeout (default of --hang-timeout): a SIGSTOPped rank is declared failed after
about 1 s (the launcher's default is 10 s; 30/30 faults survived at 1 s on 2 cores with no false hang)."""
LEAVER_CRASH = "SIGTERM>KILL"
KINDS = {"SIGKILL": 5, "SIGSTOP": 2, "SIGTERM": 2, LEAVER_CRASH: 2}
"""Relative frequency of each kind of fault in the schedule."""
PAIR_PROBABILITY = 0.25
TRAP_PROBABILITY = 0.7
RECOVERY_PROBABILITY = 0.5
"""Of a pair that is killed or hung at traps: the second is parked at the survivors' recovery."""
SECOND_POINTS = ("recovery", "building")
"""Where: at the start of the survivors' recovery from the first, or once every survivor entered the
recovery's epoch, before its world exists."""
TREE_PROBABILITY = 0.5
"""The share of faults whose signals go to the rank's whole process group, as Slurm sends them."""
JOINER_CRASH_PROBABILITY = 0.2
POINTS = ("F", "B", "W", "allreduce", "stepped")
WARMUP = 2
"""Fault-free iterations before the first fault."""
ITERATIONS_PER_FAULT = 8
"""Steps budgeted per fault: the trap two iterations ahead, DEGRADED_ITERATIONS, the re-join."""
MARGIN = 10
TOLERANCE = 1e-5
"""rtol = atol of the campaign's comparison with the fault-free run. The tests' (jobs.RTOL, ATOL =
1e-6, 1e-7) hold for their 24 iterations; over longer jobs with many re-ordered gradient sums fp32
noise reaches a few 1e-7 (Adam), while a lost, repeated or un-undone micro-batch or step moves
parameters by about lr x gradient, 1e-4 and more. Both verdicts are reported."""
KILL_GOAL_S, HANG_GOAL_S = 0.5, 1.5
"""Median goals: SIGKILL to running on the new plan; SIGSTOP (from its detection) to running."""
PENDING_JOIN = "signal SIGKILL while its join was pending"


@dataclass(frozen=True)
class Shape:
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.pp * self.dp


@dataclass
class Fault:
    index: int
    job: int
    signal: str
    """SIGKILL, SIGSTOP, SIGTERM or LEAVER_CRASH."""
    workers: list[tuple[int, int]]
    """(pipeline, stage) of each worker signalled."""
    slots: list[int]
    moment: str
    """``trap`` (``points``, one per worker) or ``clock`` (``fraction`` of an iteration after a boundary)."""
    points: list[str] = field(default_factory=list)
    fraction: float = 0.0
    tree: bool = False
    """The signals go to the rank's whole process group (each rank leads a session of its own)."""
    joiner_crash: bool = False
    """The first worker's respawn is SIGKILLed while its join is pending."""
    iteration: int = -1
    """Filled by the run: the iteration the fault was aimed at."""
    in_flight: int = -1
    """Filled by the run: the least iteration count over every rank at the first signal."""
    signalled: list[float] = field(default_factory=list)
    """When the fault's last signal reached each worker (a crashing leaver: its SIGKILL)."""
    joiner_published: bool | None = None
    """Filled by the run for a crashing joiner: its death was published as a pending joiner's."""

    def describe_workers(self) -> str:
        return " ".join(f"({p},{s})" for p, s in self.workers)

    def describe_moment(self) -> str:
        to = " (group)" if self.tree else ""
        joiner = " +joiner" if self.joiner_crash else ""
        if self.moment == "trap":
            return "trap " + ",".join(self.points) + to + joiner
        return f"+{self.fraction:.2f} iteration{to}{joiner}"


@dataclass
class Row:
    """What one fault did, measured from every process's records."""

    index: int
    job: int
    signal: str
    workers: str
    moment: str
    iteration: int
    detection_s: float | None = None
    new_plan_s: float | None = None
    published_to_plan_s: float | None = None
    """From the coordinator's record of the fault (waitpid, the hang declared, the leave request)."""
    rejoin_start_s: float | None = None
    rejoin_request_s: float | None = None
    in_flight: int = -1
    restart: int | None = None
    handled: bool = False
    """An epoch without the fault's workers and a later one back on the fault-free plan were found."""
    joiner_ok: bool = True
    """No crashing joiner, or its death was published as a pending joiner's."""
    survived: bool = False
    note: str = ""

    @property
    def lost_ok(self) -> bool:
        return self.restart is not None and self.restart >= self.in_flight


@dataclass
class JobResult:
    number: int
    optimizer: str
    data: str
    steps: int
    exit_code: int | None
    error: str = ""
    states_equal: bool = False
    """Parameters, optimizer state and losses within TOLERANCE of the fault-free run."""
    strictly_equal: bool = False
    """... within the tests' tolerances."""
    ledger_exact: bool = False
    worst_difference: float = math.nan
    wall_seconds: float = 0.0
    rows: list[Row] = field(default_factory=list)
    log_tail: str = ""
    """The launcher's last lines and every rank log's end, when the job failed."""

    @property
    def ok(self) -> bool:
        return not self.error and self.exit_code == 0 and self.states_equal and self.ledger_exact


# ---- the schedule -------------------------------------------------------------------------------


def make_schedule(seed: int, faults: int, jobs: int, shape: Shape) -> list[Fault]:
    rng = random.Random(seed)
    sizes = [faults // jobs + (1 if j < faults % jobs else 0) for j in range(jobs)]
    schedule = []
    for job, size in enumerate(sizes):
        for _ in range(size):
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            workers = [(rng.randrange(shape.dp), rng.randrange(shape.pp))]
            if rng.random() < PAIR_PROBABILITY:
                other = rng.choice([p for p in range(shape.dp) if p != workers[0][0]])
                workers.append((other, rng.randrange(shape.pp)))
            assert all(sum(s == stage for _, s in workers) < shape.dp for stage in range(shape.pp)), "a whole stage"
            trapped = kind == LEAVER_CRASH or rng.random() < TRAP_PROBABILITY
            slots = [slot(shape.dp, p, s) for p, s in workers]
            fault = Fault(len(schedule), job, kind, workers, slots, "trap" if trapped else "clock")
            if fault.moment == "trap":
                fault.points = [rng.choice(POINTS) for _ in workers]
                if len(workers) == 2 and kind in ("SIGKILL", "SIGSTOP") and rng.random() < RECOVERY_PROBABILITY:
                    fault.points[1] = rng.choice(SECOND_POINTS)
            else:
                fault.fraction = rng.random()
            fault.tree = rng.random() < TREE_PROBABILITY
            fault.joiner_crash = rng.random() < JOINER_CRASH_PROBABILITY
            schedule.append(fault)
    return schedule


def smoke_schedule(shape: Shape) -> list[Fault]:
    """One fault for the test suite: a crashing leaver signalled as a process group (with its
    helpers), whose respawn crashes while its join is pending."""
    worker = (0, 1)
    return [Fault(0, 0, LEAVER_CRASH, [worker], [slot(shape.dp, *worker)], "trap", ["B"], tree=True, joiner_crash=True)]


# ---- one job --------------------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def progress(job: Job) -> list[int]:
    return [job.progress(s) for s in range(job.pp * job.dp)]


def exit_of(fault: Fault) -> dict:
    """The fields of the event of a signalled worker's exit (a hung rank is SIGKILLed by the
    coordinator once its failure is published)."""
    return {"code": 0} if fault.signal == "SIGTERM" else {"signal": "SIGKILL"}


def send(job: Job, fault: Fault, s: int, name: str) -> None:
    """``name`` to slot ``s``'s process, or to its process group (the rank leads it)."""
    if fault.in_flight < 0:
        fault.in_flight = min(progress(job))
    if fault.tree:
        os.killpg(job.pids[s], getattr(signal, name))
    else:
        os.kill(job.pids[s], getattr(signal, name))


def strike(job: Job, fault: Fault, s: int) -> None:
    """The fault's signals to slot ``s``: a crashing leaver gets SIGTERM, its leave is accepted,
    then SIGKILL while it is still parked before its boundary."""
    if fault.signal == LEAVER_CRASH:
        leaves = job.count_events("accepted", kind="leave", slot=s)
        send(job, fault, s, "SIGTERM")
        job.wait_for_event("accepted", leaves + 1, timeout=60, kind="leave", slot=s)
        send(job, fault, s, "SIGKILL")
    else:
        send(job, fault, s, fault.signal)
    fault.signalled.append(time.time())


def inject(job: Job, fault: Fault) -> None:
    """Signal the fault's workers at its moment, then pace the survivors and the re-join."""
    slots = fault.slots
    target = max(progress(job)) + 2
    if target + DEGRADED_ITERATIONS + 4 > job.steps:
        raise AssertionError(f"fault {fault.index} does not fit in {job.steps} steps (iteration {target})")
    fault.iteration = target
    exits = {s: job.count_events("exited", slot=s, **exit_of(fault)) for s in slots}
    joins = {s: job.count_events("accepted", kind="join", slot=s) for s in slots}
    if fault.joiner_crash:
        (job.out / f"gate{slots[0]}").write_text("")  # its respawn waits until the survivors are held
    if fault.moment == "trap":
        # A crashing leaver stays parked after its SIGTERM; other trapped ranks go on when asked to leave.
        mode = ":stay" if fault.signal == LEAVER_CRASH else ""
        pending = {s: f"j{fault.job}f{fault.index}s{s}" for s in slots}
        for s, point in zip(slots, fault.points, strict=True):
            write_atomically(job.out / f"trap{s}", f"{point}:{target}:{pending[s]}{mode}")
        while pending:
            # Whichever is parked first: a parked rank can keep the other from reaching its point.
            job.wait_until(
                lambda: any((job.out / f"trapped{s}.{t}").exists() for s, t in pending.items()),
                f"fault {fault.index}: a rank to reach its trap",
            )
            for s, token in list(pending.items()):
                if (job.out / f"trapped{s}.{token}").exists():
                    (job.out / f"trap{s}").unlink(missing_ok=True)  # a respawn must not park again
                    strike(job, fault, s)
                    del pending[s]
    else:
        watch = slots[0]
        job.wait_until(lambda: job.progress(watch) >= target - 1, f"slot {watch} at iteration {target - 1}")
        began = time.time()
        job.wait_until(lambda: job.progress(watch) >= target, f"slot {watch} at iteration {target}")
        time.sleep(fault.fraction * (time.time() - began))
        for s in slots:
            strike(job, fault, s)
    iteration = max(progress(job))
    hold_degraded(job, iteration)
    for s in slots:
        job.wait_for_event("exited", exits[s] + 1, slot=s, **exit_of(fault))
    if fault.joiner_crash:
        crash_pending_joiner(job, fault, joins)
        joins = {**joins, slots[0]: joins[slots[0]] + 1}
    rejoin(job, slots, iteration, joins)


def crash_pending_joiner(job: Job, fault: Fault, joins: dict[int, int]) -> None:
    """Once every survivor waits at the hold, let the first worker's respawn in and SIGKILL it (its
    process or group) as soon as its join is accepted: the join is still pending, since the
    survivors decide joins at their next boundary."""
    s = fault.slots[0]
    wait_until_held(job, fault.slots)
    (job.out / f"gate{s}").unlink()
    joiner = job.wait_for_event("accepted", joins[s] + 1, timeout=180, kind="join", slot=s)
    failures = job.count_events("published_failure", slot=s)
    (os.killpg if fault.tree else os.kill)(joiner["pid"], signal.SIGKILL)
    published = job.wait_for_event("published_failure", failures + 1, timeout=60, slot=s)
    fault.joiner_published = published["why"] == PENDING_JOIN


def run_reference(workdir: Path, shape: Shape, optimizer: str, data: str, steps: int, timeout: float) -> dict:
    """The final state of every slot in a fault-free run of the job."""
    tmp = workdir / f"fault_free_{optimizer}_{data}"
    try:
        return run_fault_free(tmp, shape.pp, shape.dp, steps, optimizer, timeout, data, WORKER_ARGS)
    except AssertionError as exc:
        raise SystemExit(f"the fault-free {optimizer} {data} run failed:\n{exc}") from None


@dataclass(frozen=True)
class JobPlan:
    number: int
    shape: Shape
    optimizer: str
    data: str
    """``provider``, or ``dataset`` (map-style, with helper processes beside each rank)."""
    steps: int
    timeout: float
    hang_timeout: float


def run_job(plan: JobPlan, faults: list[Fault], reference: dict, workdir: Path) -> JobResult:
    began = time.time()
    shape = plan.shape
    job = Job(workdir / f"job{plan.number}", shape.pp, shape.dp, plan.steps, job_config(), plan.optimizer, True)
    job.timeout, job.data, job.helpers = plan.timeout, plan.data, plan.data == "dataset"
    job.worker_args = list(WORKER_ARGS)
    job.launcher_args = ["--heartbeat-min-timeout", str(plan.hang_timeout)]
    result = JobResult(plan.number, plan.optimizer, plan.data, plan.steps, None)
    job.start()
    try:
        job.wait_until(lambda: min(progress(job)) >= WARMUP, "the warm-up iterations")
        for fault in faults:
            log(
                f"job {plan.number} fault {fault.index}: {fault.signal} {fault.describe_workers()} "
                f"{fault.describe_moment()}"
            )
            try:
                inject(job, fault)
            except AssertionError as exc:
                result.error = f"fault {fault.index}: {str(exc).splitlines()[0]}"
                raise
        result.exit_code = job.finish()
    except AssertionError as exc:
        result.error = result.error or str(exc).splitlines()[0]
        job.kill()
        result.exit_code = job.proc.returncode
    except BaseException:
        job.kill()
        raise
    if result.exit_code != 0:
        result.error = result.error or f"the launcher exited {result.exit_code}"
        result.log_tail = job.log_tail(6000)
    result.wall_seconds = time.time() - began
    (job.tmp / "launcher.log").write_text("\n".join(job.lines) + "\n")
    check_job(job, result, reference, plan.steps)
    result.rows = measure(job, faults, result)
    return result


def check_job(job: Job, result: JobResult, reference: dict, steps: int) -> None:
    """The tests' checks: fault-free states and losses, and the exactly-once F ledger."""
    records, killed = job.records(), job.killed()
    finished = final_states(records)
    if finished:
        result.worst_difference = worst_parameter_difference(finished, reference)
    if result.error or result.exit_code != 0:
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert_final_states(job, reference, steps)
        result.strictly_equal = True
    except AssertionError:
        pass
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert_final_states(job, reference, steps, rtol=TOLERANCE, atol=TOLERANCE)
        result.states_equal = True
    except AssertionError as exc:
        result.error = f"states differ from the fault-free run: {' '.join(str(exc).split())[:300]}"
        where = first_divergence(finished, reference, TOLERANCE)
        if where is not None:
            result.error += f"; {where}"
    changes = [c for p in processes(job).values() for c in p["changes"]]
    try:
        ledgers = [record["ledger"] for record in records] + killed_ledgers(killed, changes, job.dp)
        assert_ledger_exact(ledgers, job.pp, job.dp, M, steps)
        result.ledger_exact = True
    except (AssertionError, KeyError, IndexError) as exc:
        result.error = result.error or f"F ledger not exact: {type(exc).__name__}: {str(exc).splitlines()[0]}"


# ---- measurements -----------------------------------------------------------------------------------


def processes(job: Job) -> dict[tuple[int, int], dict]:
    """Every process's last saved state by (slot, incarnation): final records, else its ledger snapshot."""
    saved: dict[tuple[int, int], dict] = dict(job.killed())
    for record in job.records():
        saved[record["slot"], record["incarnation"]] = record
    return saved


def request_times(job: Job) -> dict[tuple[int, int], float]:
    """When the coordinator accepted each process's join request, by (slot, incarnation)."""
    started = {e["pid"]: (e["slot"], e["incarnation"]) for e in job.events.select("started")}
    return {started[e["pid"]]: e["time"] for e in job.events.select("accepted", kind="join") if e["pid"] in started}


def workers_of(entries: Iterable) -> set[tuple[int, int]]:
    return {tuple(w) for w in entries}


def measure(job: Job, faults: list[Fault], result: JobResult) -> list[Row]:
    saved = processes(job)
    requests = request_times(job)
    changes = [c for p in saved.values() for c in p["changes"]]
    rows = []
    for k, fault in enumerate(faults):
        row = Row(
            fault.index,
            fault.job,
            fault.signal,
            fault.describe_workers(),
            fault.describe_moment(),
            fault.iteration,
            in_flight=fault.in_flight,
            joiner_ok=fault.joiner_published is not False,
        )
        rows.append(row)
        if not fault.signalled:
            row.note = "not run"
            continue
        if not row.joiner_ok:
            row.note = "the crashed joiner was not published as a pending joiner"
        first, last = fault.signalled[0], fault.signalled[-1]
        end = faults[k + 1].signalled[0] if k + 1 < len(faults) and faults[k + 1].signalled else math.inf
        inside = [c for c in changes if first <= c["time"] < end]
        out = [c for c in inside if c["failed"] or c["left"]]
        # Each worker of the fault out of the plan, in one epoch or (a pair whose second hang is
        # detected after the first one's respawn re-joined) in one after the other.
        without = [{c["epoch"] for c in out if tuple(w) in workers_of(c["plan"]["failed"])} for w in fault.workers]
        back = [c for c in inside if c["joined"] and not c["plan"]["failed"]]
        if not out or not all(without):
            row.note = "no epoch without its workers"
            continue
        row.restart = min(c["iteration"] for c in out)
        first_epoch = [c for c in out if c["epoch"] == min(x["epoch"] for x in out)]
        plan_epoch = [c for c in out if c["epoch"] == max(min(epochs) for epochs in without)]
        if fault.signal != "SIGTERM":
            detected = [
                c["time"] - c["recovery_seconds"] + c["detection_seconds"]
                for c in first_epoch
                if c["recovery_seconds"] is not None
            ]
            row.detection_s = max(detected) - first if detected else None
            recovered = [c["recovery_seconds"] for c in plan_epoch if c["recovery_seconds"] is not None]
            row.published_to_plan_s = max(recovered) if recovered else None
        else:
            row.published_to_plan_s = max(c["detection_seconds"] + c["switch_seconds"] for c in plan_epoch)
        row.new_plan_s = max(c["time"] for c in plan_epoch) - last
        if not back:
            row.note = "not back on the fault-free plan"
            continue
        back_epoch = min(c["epoch"] for c in back)
        back_time = max(c["time"] for c in back if c["epoch"] == back_epoch)
        respawns = [
            key
            for key, process in saved.items()
            if key[0] in fault.slots and key[1] > 0 and first < process["process_start"] < end
        ]
        starts = [saved[key]["process_start"] for key in respawns]
        asked = [requests[key] for key in respawns if key in requests]
        row.rejoin_start_s = back_time - min(starts) if starts else None
        row.rejoin_request_s = back_time - min(asked) if asked else None
        row.handled = True
    for row in rows:
        row.survived = result.ok and row.handled and row.lost_ok and row.joiner_ok
        if result.error.startswith(f"fault {row.index}:"):
            row.note = (row.note + "; " if row.note else "") + "the job failed here"
    return rows


# ---- report -----------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def spread(values: list[float], unit: str = "ms") -> str:
    if not values:
        return "none measured"
    scale, digits = (1e3, 0) if unit == "ms" else (1.0, 2)
    median, worst = statistics.median(values) * scale, max(values) * scale
    return f"median {median:.{digits}f} {unit}, max {worst:.{digits}f} {unit} (n={len(values)})"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(
    schedule: list[Fault], results: list[JobResult], args: argparse.Namespace, shape: Shape, wall: float
) -> dict:
    rows = [row for result in results for row in result.rows]
    print(
        f"fault campaign: pp={shape.pp} x dp={shape.dp}, m={M}, seed {args.seed}, {len(schedule)} faults in "
        f"{len(results)} jobs of {results[0].steps if results else 0} steps, --heartbeat-min-timeout "
        f"{args.hang_timeout:g} s, {os.cpu_count()} cores; wall time {wall:.0f} s"
    )
    for result in results:
        status = "ok" if result.ok else f"FAILED: {result.error}"
        data = "map-style dataset + helper processes" if result.data == "dataset" else "provider"
        print(
            f"  job {result.number} ({result.optimizer}, {data}): exit {result.exit_code}, {len(result.rows)} faults, "
            f"{result.wall_seconds:.0f} s, max |param - fault-free| {result.worst_difference:.3g} "
            f"(within the tests' tolerance: {'yes' if result.strictly_equal else 'no'}), {status}"
        )
    print("per fault (times: detection and to-new-plan in ms, re-join in s; restart/in-flight = iterations):")
    print(
        f"{'#':>3} {'job':>3} {'signal':13}{'workers':12}{'moment':31}{'it':>4}{'detect':>8}{'plan':>7}"
        f"{'pub>plan':>9}{'rejoin':>8}{'req>back':>9}{'restart':>8}{'in-fl':>6}  ok"
    )
    for row in rows:
        print(
            f"{row.index:3d} {row.job:3d} {row.signal:13}{row.workers:12}{row.moment:31}{row.iteration:4d}"
            f"{milliseconds(row.detection_s):>8}{milliseconds(row.new_plan_s):>7}"
            f"{milliseconds(row.published_to_plan_s):>9}{seconds(row.rejoin_start_s):>8}"
            f"{seconds(row.rejoin_request_s):>9}{str(row.restart):>8}{row.in_flight:6d}  "
            f"{'yes' if row.survived else 'NO'}{' ' + row.note if row.note else ''}"
        )

    def values(attribute: str, sig: str | None = None) -> list[float]:
        chosen = [r for r in rows if sig is None or r.signal == sig]
        return [getattr(r, attribute) for r in chosen if getattr(r, attribute) is not None]

    survived = sum(row.survived for row in rows)
    worst = max((r.worst_difference for r in results if not math.isnan(r.worst_difference)), default=math.nan)
    kill, hang = values("new_plan_s", "SIGKILL"), values("new_plan_s", "SIGSTOP")
    ran = [row for row in rows if row.in_flight >= 0]
    finished = [r for r in results if r.exit_code == 0]
    lost_ok = all(row.lost_ok for row in ran) and all(r.ledger_exact for r in finished)
    goals = {
        "100% survived": survived == len(schedule),
        f"SIGKILL to running on the new plan, median <= {KILL_GOAL_S:g} s": bool(kill)
        and statistics.median(kill) <= KILL_GOAL_S,
        f"SIGSTOP to running on the new plan, median <= {HANG_GOAL_S:g} s": bool(hang)
        and statistics.median(hang) <= HANG_GOAL_S,
        "lost work at most the in-flight iteration": lost_ok,
    }
    print(f"survived: {survived}/{len(schedule)}")
    equal, strict = sum(r.states_equal for r in results), sum(r.strictly_equal for r in results)
    print(
        f"worst |parameter - fault-free parameter| over every slot of every job: {worst:.3g} "
        f"(states equal within rtol = atol = {TOLERANCE:g}: {equal}/{len(results)} jobs; "
        f"within the tests' rtol 1e-6, atol 1e-7: {strict}/{len(results)})"
    )
    group = [f for f in schedule if f.tree and f.signalled]
    joiners = [f for f in schedule if f.joiner_crash and f.joiner_published is not None]
    print(
        f"signals to the whole process group: {len(group)} faults ({sum(f.signal == 'SIGTERM' for f in group)} "
        f"leaves); crashed leavers: {sum(f.signal == LEAVER_CRASH for f in schedule if f.signalled)}; "
        f"crashed pending joiners: {len(joiners)}, published as such: {sum(bool(f.joiner_published) for f in joiners)}"
    )
    print(f"detection (signal to every survivor stopped): SIGKILL {spread(values('detection_s', 'SIGKILL'))}")
    print(f"  crashed leaver (from its SIGKILL) {spread(values('detection_s', LEAVER_CRASH))}")
    print(
        f"  SIGSTOP {spread(values('detection_s', 'SIGSTOP'), 's')} "
        f"(heartbeat timeout max({args.hang_timeout:g} s, 3 x slowest iteration))"
    )
    print(f"SIGKILL to running on the new plan: {spread(kill)}")
    print(f"crashed leaver, its SIGKILL to running on the new plan: {spread(values('new_plan_s', LEAVER_CRASH))}")
    print(
        f"SIGSTOP to running on the new plan: {spread(hang, 's')}; "
        f"from the hang's detection: {spread(values('published_to_plan_s', 'SIGSTOP'))}"
    )
    print(f"SIGTERM (leave) to running on the new plan: {spread(values('new_plan_s', 'SIGTERM'))}")
    print(
        f"re-join, respawned process start to back on the fault-free plan: {spread(values('rejoin_start_s'), 's')}; "
        f"join accepted to back: {spread(values('rejoin_request_s'), 's')}"
    )
    restarts = f"{sum(row.lost_ok for row in ran)}/{len(ran)} faults run restarted at or after the iteration in flight"
    ledgers = f"F ledger exact in {sum(r.ledger_exact for r in finished)}/{len(finished)} jobs that finished"
    print(f"lost work: {restarts}; {ledgers}")
    for goal, ok in goals.items():
        print(f"goal: {goal}: {verdict(ok)}")
    return {
        "seed": args.seed,
        "wall_seconds": wall,
        "schedule": [asdict(f) for f in schedule],
        "jobs": [{**asdict(r), "rows": [asdict(row) for row in r.rows]} for r in results],
        "survived": survived,
        "total": len(schedule),
        "worst_difference": worst,
        "goals": goals,
    }


def print_schedule(schedule: list[Fault]) -> None:
    print("schedule ((p,s) = (pipeline, stage); each fault lands two iterations after the previous re-join):")
    for fault in schedule:
        workers, moment = fault.describe_workers(), fault.describe_moment()
        print(f"  {fault.index:3d} job {fault.job} {fault.signal:13}{workers:12}{moment}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=3, help="launches the faults are split over")
    parser.add_argument("--optimizer", choices=["sgd", "adam", "alternate"], default="alternate")
    parser.add_argument(
        "--data",
        choices=["provider", "dataset", "alternate"],
        default="alternate",
        help="training_data: a provider, a map-style dataset with helper processes, or one then the other",
    )
    parser.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT, help="--heartbeat-min-timeout, s")
    parser.add_argument("--timeout", type=float, default=1200.0, help="bound on each launch, seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write the schedule and rows here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the jobs' files in this directory")
    parser.add_argument(
        "--smoke", action="store_true", help="pp=2 x dp=2, one fixed fault in one job (for the test suite)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: clean up the job's ranks
    began = time.time()
    if args.smoke:
        shape = Shape(2, 2)
        args.jobs, args.optimizer, args.data, args.timeout = 1, "sgd", "dataset", 300.0
        schedule = smoke_schedule(shape)
    else:
        shape = Shape(PP, DP)
        schedule = make_schedule(args.seed, args.faults, args.jobs, shape)
    print_schedule(schedule)
    sys.stdout.flush()
    per_job = max(sum(f.job == j for f in schedule) for j in range(args.jobs))
    steps = WARMUP + ITERATIONS_PER_FAULT * per_job + MARGIN
    workdir = Path(tempfile.mkdtemp(prefix="ds_recycle_campaign_")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        references: dict[tuple[str, str], dict] = {}
        for number in range(args.jobs):
            optimizer = args.optimizer if args.optimizer != "alternate" else ("sgd", "adam")[number % 2]
            data = args.data if args.data != "alternate" else ("provider", "dataset")[number % 2]
            if (optimizer, data) not in references:
                log(f"fault-free reference run ({optimizer}, {data}, {steps} steps)")
                references[optimizer, data] = run_reference(workdir, shape, optimizer, data, steps, args.timeout)
            faults = [f for f in schedule if f.job == number]
            log(f"job {number}: {len(faults)} faults, {optimizer}, {data}, {steps} steps")
            plan = JobPlan(number, shape, optimizer, data, steps, args.timeout, args.hang_timeout)
            results.append(run_job(plan, faults, references[optimizer, data], workdir))
            if results[-1].error:
                log(f"job {number} failed: {results[-1].error}; files in {workdir / f'job{number}'}")
                log(results[-1].log_tail)
    finally:
        if args.keep is None and all(r.ok for r in results):
            shutil.rmtree(workdir, ignore_errors=True)
    summary = report(schedule, results, args, shape, time.time() - began)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    if args.smoke and summary["survived"] != summary["total"]:
        raise SystemExit("smoke: a fault was not survived")


if __name__ == "__main__":
    main()
