"""Run a ReCycle job under ``ds-recycle launch`` and act on it from outside, as an operator would.

:class:`Job` starts the launcher as a subprocess with ``--events``, watches its event stream
(:class:`~ds_recycle.testing.launch_events.LaunchEvents`: which process each slot runs, exits,
failures, accepted joins) and each slot's progress file, and sends real signals to the ranks' PIDs.
It keeps the launcher's log lines too (``count`` and ``wait_for_line`` look for a line: the tests
check what a user reads). Every wait is bounded; on any error the launcher's process group is
killed, by PID.

The rest of the module is the one job shape of the membership and failure tests and benchmarks,
and the checks of a job against a fault-free run of it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_recycle.runtime.node.preload import preloaded_by
from ds_recycle.testing.launch_events import LaunchEvents
from ds_recycle.testing.tiny import ds_config

WORKER = Path(__file__).with_name("worker.py")


@dataclass
class Job:
    tmp: Path
    pp: int
    dp: int
    steps: int
    config: dict
    optimizer: str = "adam"
    respawn: bool = True
    respawn_delay: float = 0.2
    """``--respawn-delay``: seconds from a rank's end to its respawn."""
    timeout: float = 240.0
    traps: list[str] = field(default_factory=list)
    """``SLOT:POINT:ITERATION``: where a rank parks for the test's signal (ds_recycle.testing.faults)."""
    launcher_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    """More options of the rank script (ds_recycle/testing/worker.py: --trap-files, --gate, --timings)."""
    data: str = "provider"
    """``training_data``: ``provider`` or ``dataset`` (map-style)."""
    helpers: bool = False
    """Each rank starts helper processes (DataLoader workers, a forked process) as scripts do."""
    argv: list[str] | None = None
    """Another rank script and its arguments (it writes ``out/progress<slot>`` and honours ``out/hold``)."""
    env: dict[str, str] = field(default_factory=dict)
    preload: bool = True
    """Fork the ranks from a preloaded process (``--preload``: seconds less per start); False: exec."""
    backend: str = "gloo"
    """``--backend``: ``gloo`` (CPU) or ``nccl`` (CUDA, no preload: each rank is exec'd)."""
    lines: list[str] = field(default_factory=list)
    held_at: int | None = field(default=None, init=False)
    """The iteration :meth:`hold` holds the ranks at (None: they go on)."""

    def __post_init__(self) -> None:
        self.out = self.tmp / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        (self.tmp / "ds_config.json").write_text(json.dumps(self.config))
        self.events = LaunchEvents(self.tmp / "events.jsonl")

    @property
    def pids(self) -> dict[int, int]:
        """Each slot's current process (its latest start)."""
        return self.events.pids()

    def start(self) -> Job:
        launcher = [sys.executable, "-m", "ds_recycle.cli", "launch", "--nproc", str(self.pp * self.dp)]
        if self.respawn:
            launcher += ["--respawn", "--respawn-delay", str(self.respawn_delay)]
        launcher += ["--timeout", str(self.timeout), "--log-dir", str(self.tmp / "logs")]
        nccl = self.backend == "nccl"
        preload = ["--preload"] if self.preload and not nccl else []
        launcher += ["--events", str(self.events.path), "--backend", self.backend, *preload, *self.launcher_args]
        script = self.argv or [
            str(WORKER),
            *("--pp", str(self.pp), "--steps", str(self.steps), "--optimizer", self.optimizer),
            *("--config", str(self.tmp / "ds_config.json"), "--out", str(self.out), "--data", self.data),
            *(arg for trap in self.traps for arg in ("--trap", trap)),
            *(["--helpers"] if self.helpers else []),
            *self.worker_args,
        ]
        env = {**os.environ, "DS_ACCELERATOR": "cuda" if nccl else "cpu", **self.env}
        self.proc = subprocess.Popen(
            launcher + script,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def progress(self, slot: int) -> int:
        path = self.out / f"progress{slot}"
        return int(path.read_text() or 0) if path.exists() else 0

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended while waiting for {what}:\n" + self.log_tail())
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"timed out waiting for {what}:\n" + self.log_tail())

    def signal_at(self, slots: list[int], iteration: int, sig: int = signal.SIGTERM, watch: int | None = None) -> None:
        """Send ``sig`` to ``slots`` once slot ``watch`` (default: the first of them) has finished ``iteration``."""
        watch = slots[0] if watch is None else watch
        self.wait_until(lambda: self.progress(watch) >= iteration, f"slot {watch} at iteration {iteration}")
        pids = {slot: self.pids[slot] for slot in slots}
        for pid in pids.values():
            os.kill(pid, sig)

    def signal_tree_at(self, slots: list[int], iteration: int, sig: int = signal.SIGTERM) -> list[int]:
        """As a cluster delivers a preemption notice: ``sig`` to every process of each rank's tree
        (its process group: the launcher starts each rank in a session of its own) once the first
        of ``slots`` has finished ``iteration``. Returns the PIDs the signal reached."""
        self.wait_until(lambda: self.progress(slots[0]) >= iteration, f"slot {slots[0]} at iteration {iteration}")
        reached = []
        for slot in slots:
            pid = self.pids[slot]
            reached += [p for p in _pids() if _pgid(p) == pid]
            os.killpg(pid, sig)
        return reached

    def signal_when_trapped(self, slot: int, sig: int = signal.SIGKILL) -> None:
        """Wait until ``slot`` parks at its trap, then send it ``sig``."""
        self.wait_until(lambda: (self.out / f"trapped{slot}").exists(), f"slot {slot} to reach its trap")
        os.kill(self.pids[slot], sig)

    def hold(self, iteration: int | None) -> None:
        """Make every rank wait at the boundary once it has finished ``iteration`` iterations (None: go on)."""
        path = self.out / "hold"
        self.held_at = iteration
        if iteration is None:
            path.unlink(missing_ok=True)
            return
        partial = self.out / "hold.partial"
        partial.write_text(str(iteration))
        os.replace(partial, path)

    def count_events(self, event: str, **match: Any) -> int:
        """How many ``event`` events whose fields equal ``match`` the launcher wrote so far."""
        return self.events.count(event, **match)

    def wait_for_event(self, event: str, count: int = 1, timeout: float = 120.0, **match: Any) -> dict:
        """Wait for the ``count``-th ``event`` whose fields equal ``match``; returns it."""
        self.wait_until(lambda: self.events.count(event, **match) >= count, f"event {event} #{count} {match}", timeout)
        return self.events.select(event, **match)[count - 1]

    def count(self, pattern: str) -> int:
        """Launcher log lines that match ``pattern``."""
        regex = re.compile(pattern)
        return sum(bool(regex.search(x)) for x in list(self.lines))

    def count_in_rank_logs(self, pattern: str) -> int:
        regex = re.compile(pattern)
        return sum(
            bool(regex.search(line))
            for path in (self.tmp / "logs").glob("*.log")
            for line in path.read_text(errors="replace").splitlines()
        )

    def wait_for_line(self, pattern: str, count: int = 1, timeout: float = 120.0) -> None:
        self.wait_until(lambda: self.count(pattern) >= count, pattern, timeout)

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=self.timeout + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the launcher did not end:\n" + self.log_tail()) from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """Kill the launcher, then every rank it started: each rank has a session of its own, so
        the launcher's process group does not hold them. A PID is killed only while its command
        line still names this job's directory, or this job's launcher as the agent of a preloaded
        rank (it is ours, not a recycled PID)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.events.all_pids():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                if str(self.out) in " ".join(command) or preloaded_by(command) == self.proc.pid:
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass

    def log_tail(self, chars: int = 8000) -> str:
        logs = "\n".join(self.lines[-60:])
        for path in sorted((self.tmp / "logs").glob("*.log")):
            logs += f"\n--- {path.name} ---\n" + path.read_text()[-2000:]
        return logs[-chars:]

    def records(self) -> list[dict]:
        """The final records of the processes that ended by themselves (finished or left)."""
        return [torch.load(p, weights_only=False) for p in sorted(self.out.glob("[0-9]*.pt"))]

    def killed(self) -> dict[tuple[int, int], dict]:
        """What the processes that left no final record (killed) saved after their last iteration,
        by (slot, incarnation)."""
        ended = {path.name for path in self.out.glob("[0-9]*.pt")}
        saved = {}
        for path in self.out.glob("ledger*.pt"):
            slot, incarnation = path.name[len("ledger") : -len(".pt")].split(".")
            if f"{slot}.{incarnation}.pt" not in ended:
                saved[int(slot), int(incarnation)] = torch.load(path, weights_only=False)
        return saved


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def final_states(records: list[dict]) -> dict[int, dict]:
    """The state of every slot that finished the job, by slot."""
    return {r["slot"]: r for r in records if r.get("finished")}


# ---- one job shape for the membership and failure tests ------------------------------------------

M = 4
CLIP = 0.5
EMULATION = {"emulate_timing": {"F": 8, "B": 8, "W": 8}}
RTOL, ATOL = 1e-6, 1e-7
DEGRADED_ITERATIONS = 4
"""Iterations the survivors run on the adapted plan before the test lets a respawned rank re-join."""

_fault_free: dict[tuple, dict[int, dict]] = {}


def slot(dp: int, pipeline: int, stage: int) -> int:
    """The rank of worker (pipeline, stage): DeepSpeed's pipe-data topology is stage-major."""
    return stage * dp + pipeline


def job_config() -> dict:
    return ds_config(M, CLIP, {"enabled": True, **EMULATION})


def fault_free(
    tmp_path_factory, pp: int, dp: int, steps: int, optimizer: str, data: str = "provider", backend: str = "gloo"
) -> dict[int, dict]:
    """The final state of every slot in a fault-free run of the job (run once per test session)."""
    key = (pp, dp, steps, optimizer, data, backend)
    if key not in _fault_free:
        tmp = tmp_path_factory.mktemp(f"fault_free_pp{pp}dp{dp}_{optimizer}_{data}_{backend}")
        _fault_free[key] = run_fault_free(tmp, pp, dp, steps, optimizer, data=data, backend=backend)
    return _fault_free[key]


def run_fault_free(
    tmp: Path,
    pp: int,
    dp: int,
    steps: int,
    optimizer: str,
    timeout: float = 240.0,
    data: str = "provider",
    worker_args: list[str] | None = None,
    backend: str = "gloo",
) -> dict[int, dict]:
    """Run the job without a failure in ``tmp``; the final state of every slot."""
    job = Job(tmp, pp, dp, steps, job_config(), optimizer, respawn=False, timeout=timeout, data=data, backend=backend)
    job.worker_args = list(worker_args or [])
    code = job.start().finish()
    assert code == 0, job.log_tail()
    return final_states(job.records())


def hold_degraded(job: Job, iteration: int) -> None:
    """Right after a fault at ``iteration``: the survivors run a few iterations on the adapted plan,
    then wait at a boundary. Set before anything slow (a leaver's exit, a respawn) so that a loaded
    machine cannot let them run to the end of the job before the re-join."""
    job.hold(iteration + DEGRADED_ITERATIONS)


def wait_until_held(job: Job, away: list[int], timeout: float = 120.0) -> None:
    """After :meth:`Job.hold`: wait until every slot but ``away`` has run up to the hold and waits
    there (a respawn let in now asks while no boundary decides its join)."""
    survivors = [s for s in range(job.pp * job.dp) if s not in away]

    def held() -> bool:
        return min(job.progress(s) for s in survivors) >= job.held_at

    job.wait_until(held, "the survivors at the hold", timeout)


def rejoin(job: Job, slots: list[int], iteration: int, joins: dict[int, int]) -> None:
    """After :func:`hold_degraded` at ``iteration``: wait until the respawns of ``slots`` are
    accepted (``joins``: accepted joins per slot before), then let everyone train."""
    for s in slots:
        job.wait_for_event("accepted", joins[s] + 1, timeout=180, kind="join", slot=s)
    job.hold(None)
    for s in slots:
        job.wait_until(lambda s=s: job.progress(s) > iteration + 1, f"slot {s} to train again after re-joining")


def assert_same_as_fault_free(job: Job, reference: dict[int, dict], steps: int) -> None:
    """Every parameter and optimizer state of every finishing slot, and every loss any process
    reported, equal the fault-free run; the F ledger of all processes, killed ones included, shows
    every micro-batch of every iteration exactly once per stage."""
    assert_every_microbatch_once(job, assert_final_states(job, reference, steps), steps)


def assert_every_microbatch_once(job: Job, records: list[dict], steps: int) -> None:
    """The F ledger of every process of ``job`` (``records``: the final ones; killed processes'
    saved ledgers up to their end) has every micro-batch of every iteration exactly once per stage."""
    finished = final_states(records)
    ledgers = [record["ledger"] for record in records]
    ledgers += killed_ledgers(job.killed(), [c for r in finished.values() for c in r["changes"]], job.dp)
    assert_ledger_exact(ledgers, job.pp, job.dp, M, steps)


def worst_parameter_difference(finished: dict[int, dict], reference: dict[int, dict]) -> float:
    """Largest |parameter - fault-free parameter| over the finishing slots the reference has."""
    return max(
        (record["params"][name] - value).abs().max().item()
        for s, record in finished.items()
        if s in reference
        for name, value in reference[s]["params"].items()
    )


def first_divergence(finished: dict[int, dict], reference: dict[int, dict], rtol: float) -> str | None:
    """Where the finishing processes' parameters first left the fault-free run, from the per-iteration
    parameter digests (``parameter_digest``): the earliest iteration, and every slot and parameter
    that differs there; None if no digest differs beyond ``rtol`` (relative, at least 1e-6 absolute)."""
    found: dict[int, list[str]] = {}
    for s, record in finished.items():
        want, names = reference.get(s, {}).get("digests", {}), list(record["params"])
        for iteration, digest in sorted(record.get("digests", {}).items()):
            expected = want.get(iteration)
            if expected is None:
                continue
            off = [
                f"slot {s} {name} ({got - value:+.3g})"
                for name, got, value in zip(names, digest, expected, strict=True)
                if abs(got - value) > max(rtol * abs(value), 1e-6)
            ]
            if off:
                found.setdefault(iteration, []).extend(off)
                break
    if not found:
        return None
    iteration = min(found)
    return f"first differs after iteration {iteration}: {', '.join(found[iteration][:6])}"


def assert_final_states(
    job: Job, reference: dict[int, dict], steps: int, rtol: float = RTOL, atol: float = ATOL
) -> list[dict]:
    """Every parameter and optimizer state of every finishing slot, and every loss any process
    reported, equal the fault-free run (``rtol``, ``atol``; a loss within ``rtol`` relative, as
    ``pytest.approx(rel=rtol)``); returns the records."""
    records = job.records()
    finished = final_states(records)
    assert sorted(finished) == sorted(reference), f"finished slots {sorted(finished)}"
    worst = worst_parameter_difference(finished, reference)
    print(f"max |parameter - fault-free parameter| over {len(finished)} workers: {worst:.3g}")
    reference_losses = next(iter(reference.values()))["losses"]
    where = first_divergence(finished, reference, rtol)
    for s, record in finished.items():
        want = reference[s]
        assert record["global_steps"] == steps
        for name, value in want["params"].items():
            message = f"slot {s} {name}" + ("" if where is None else f" ({where})")
            torch.testing.assert_close(record["params"][name], value, rtol=rtol, atol=atol, msg=message)
        for index, state in want["optimizer"]["state"].items():
            for key, value in state.items():
                got = record["optimizer"]["state"][index][key]
                torch.testing.assert_close(got, value, rtol=rtol, atol=atol, msg=f"slot {s} optimizer {index}.{key}")
    for record in records:
        for iteration, loss in record["losses"].items():
            want = reference_losses[iteration]
            assert abs(loss - want) <= max(rtol * abs(want), 1e-12), f"slot {record['slot']} it {iteration}"
    return records


def killed_ledgers(killed: dict[tuple[int, int], dict], changes: list[dict], dp: int) -> list[list]:
    """The F entries a killed process ran and that counted: the survivors re-ran every iteration
    from the one their recovery restarted at, so the dead process's entries from there on are void.

    A process ends at the first change after the epoch it joined in that names its worker as failed
    or left (a process killed after its leave took effect left at that boundary)."""
    ends = sorted(
        {(c["epoch"], c["iteration"], *(frozenset(map(tuple, c[k])) for k in ("failed", "left"))) for c in changes}
    )
    ledgers = []
    for (s, incarnation), saved in sorted(killed.items()):
        worker = (s % dp, s // dp)
        restart = next(
            (it for epoch, it, failed, left in ends if epoch > saved["joined_epoch"] and worker in failed | left), None
        )
        if restart is None:
            raise AssertionError(
                f"slot {s} incarnation {incarnation} was killed, but no change after epoch "
                f"{saved['joined_epoch']} says that worker {worker} failed or left"
            )
        ledgers.append([entry for entry in saved["ledger"] if entry[0] < restart])
    return ledgers


def assert_ledger_exact(ledgers: list[list], pp: int, dp: int, m: int, steps: int) -> None:
    """Every micro-batch of every iteration ran F exactly once per stage, across all processes."""
    counts: dict[tuple[int, int, int, int], int] = {}
    for ledger in ledgers:
        for entry in ledger:
            counts[tuple(entry)] = counts.get(tuple(entry), 0) + 1
    expected = {(i, h, k, s) for i in range(steps) for h in range(dp) for k in range(m) for s in range(pp)}
    missing = sorted(expected - counts.keys())
    twice = sorted(key for key, n in counts.items() if n != 1)
    extra = sorted(counts.keys() - expected)
    assert not missing and not twice and not extra, f"missing {missing[:5]}, repeated {twice[:5]}, extra {extra[:5]}"
