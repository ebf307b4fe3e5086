"""One rank of bench/failures.py and bench/fault_campaign.py, started by ``ds-recycle launch``.

It runs the tiny GPT of tests/runtime/membership_worker.py (same model, optimizer, provider and
records, so the tests' fault-free comparisons apply) and adds what the benchmarks need, all driven
by files in ``--out`` so that one script serves both:

- ``ledger<slot>.<incarnation>.pt`` after every iteration and every F (what a SIGKILLed process leaves behind;
  recycle_job.Job.killed reads it): the F ledger and the losses as in the test worker, plus for
  every ``train_batch`` call its start and end wall time, the iterations finished, the epoch and
  the plan summary, the membership changes this process saw and when it started and joined.
- ``gate<slot>``: while it exists, a respawned process (incarnation > 0) waits before it imports
  anything heavy, so the benchmark chooses when a worker comes back (and its import does not load
  the CPU while other phases are measured).
- ``trap<slot>`` (``POINT:ITERATION:TOKEN``, read at every iteration boundary): park at POINT (F, B,
  W, allreduce, stepped or recovery) of that iteration and write ``trapped<slot>.<TOKEN>``, so that
  the benchmark's signal lands exactly there. Unlike the test worker, a trap works in any
  incarnation, and a parked rank that gets SIGTERM (a leave) stops parking and finishes the iteration.
- ``hold``: the tests' pacing (wait at the boundary after that many iterations).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PROCESS_START = time.time()


def _argument(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def wait_at_gate() -> None:
    """A respawned process waits while ``gate<slot>`` exists (stdlib only: no CPU load meanwhile)."""
    if int(os.environ.get("DS_RECYCLE_INCARNATION", "0")) == 0:
        return
    gate = Path(_argument("--out")) / f"gate{os.environ['RANK']}"
    while gate.exists():
        time.sleep(0.05)


wait_at_gate()
STARTED = time.time()
"""After the gate: when this process started to build its engine."""

from types import MethodType  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from membership_worker import build_engine, report_progress, save_atomically, start_rank, wait_while_held  # noqa: E402

from ds_recycle.instructions.routed import BackwardInput, BackwardWeight, ForwardPass, StaggeredStep  # noqa: E402
from ds_recycle.runtime.distributed import membership_agent  # noqa: E402
from ds_recycle.runtime.recovery import Phase  # noqa: E402

POINTS = ("F", "B", "W", "allreduce", "stepped", "recovery")
PARK_SECONDS = 120.0


class SavedLedger(list):
    """The F ledger, saved again after every entry. A rank killed or hung at a random moment may
    have done all its work of an iteration that the survivors then commit, before its end-of-iteration
    save: its F entries must still be on disk (entries of iterations the recovery re-ran are voided
    by the checker)."""

    def __init__(self, save) -> None:
        super().__init__()
        self.save = save

    def append(self, entry) -> None:
        super().append(entry)
        self.save()


class Traps:
    """The trap the benchmark asked for through ``trap<slot>``; installed once, re-read at boundaries."""

    def __init__(self, engine, out: Path, slot: int, save) -> None:
        self.engine, self.out, self.slot, self.save = engine, out, slot, save
        self.request: tuple[str, int, str] | None = None
        self.fired: set[str] = set()
        self._install()

    def refresh(self) -> None:
        path = self.out / f"trap{self.slot}"
        try:
            point, iteration, token = path.read_text().strip().split(":")
        except (FileNotFoundError, ValueError):
            self.request = None
            return
        self.request = (point, int(iteration), token)

    def _armed(self, point: str) -> bool:
        if self.request is None or self.request[0] != point or self.request[2] in self.fired:
            return False
        steps = self.engine.global_steps
        return steps >= self.request[1] if point == "recovery" else steps == self.request[1]

    def _spring(self) -> None:
        token = self.request[2]
        self.fired.add(token)
        self.save()
        (self.out / f"trapped{self.slot}.{token}").write_text(f"{time.time()!r}")
        agent = membership_agent()
        deadline = time.monotonic() + PARK_SECONDS
        while time.monotonic() < deadline and not (agent is not None and agent.leave_requested):
            time.sleep(0.005)

    def _install(self) -> None:
        engine = self.engine

        def before(point: str, run):
            def trapped(owner, *args, **kwargs):
                if self._armed(point):
                    self._spring()
                return run(owner, *args, **kwargs)

            return trapped

        def after(point: str, run):
            def trapped(owner, *args, **kwargs):
                result = run(owner, *args, **kwargs)
                if self._armed(point):
                    self._spring()
                return result

            return trapped

        kinds = {"F": ForwardPass, "B": BackwardInput, "W": BackwardWeight}
        table = dict(engine._INSTRUCTION_MAP)
        for point, kind in kinds.items():
            table[kind] = before(point, table[kind])
        table[StaggeredStep] = after("stepped", table[StaggeredStep])
        engine._INSTRUCTION_MAP = table
        engine.allreduce_bucket = MethodType(before("allreduce", type(engine).allreduce_bucket), engine)
        engine.runtime.phase_listeners.append(self._at_phase)

    def _at_phase(self, phase: Phase) -> None:
        if phase is Phase.RECOVERING and self._armed("recovery"):
            self._spring()


def changes(engine) -> list[dict]:
    return [{**vars(c), "plan": None if c.plan is None else vars(c.plan)} for c in engine.membership_changes]


def main() -> None:
    args, slot, incarnation = start_rank("not used: traps come from files")

    engine = build_engine(args.pp, args.optimizer, args.config)
    joined = time.time()
    losses: dict[int, float] = {}
    calls: list[dict] = []
    timing = {"process_start": PROCESS_START, "started": STARTED, "joined": joined, "joined_at": engine.global_steps}

    def snapshot() -> dict:
        return {
            "ledger": list(engine.forward_ledger),
            "losses": dict(losses),
            "changes": changes(engine),
            "calls": list(calls),
            **timing,
        }

    def save() -> None:
        save_atomically(snapshot(), args.out / f"ledger{slot}.{incarnation}.pt")

    engine.forward_ledger = SavedLedger(save)
    traps = Traps(engine, args.out, slot, save)
    record = {"slot": slot, "incarnation": incarnation, "worker": engine.worker}
    try:
        while engine.global_steps < args.steps:
            wait_while_held(args.out / "hold", engine)
            traps.refresh()
            began = time.time()
            loss = float(engine.train_batch())
            ended = time.time()
            # After a recovery the call may have re-run an earlier iteration: it returns the loss of
            # the iteration it finished last.
            losses[engine.global_steps - 1] = loss
            epoch = engine.grid.membership.epoch
            calls.append({"start": began, "end": ended, "done": engine.global_steps, "epoch": epoch})
            if len(calls) == 1 or calls[-2]["epoch"] != epoch:
                calls[-1]["plan"] = vars(engine.plan_summary())
            save()
            report_progress(args.out, slot, engine.global_steps)
        record["finished"] = True
    finally:
        record.update(
            snapshot(),
            params={k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            optimizer=engine.optimizer.state_dict(),
            global_steps=engine.global_steps,
        )
        save_atomically(record, args.out / f"{slot}.{incarnation}.pt")


if __name__ == "__main__":
    main()
