"""One rank of a ReCycle job driven from outside, started by ``ds-recycle launch`` (or respawned by
it): the rank script of :class:`ds_recycle.testing.jobs.Job`, for the tests and the benchmarks.

It trains the tiny GPT with ReCycle until ``--steps`` iterations are done and leaves in ``--out``:

- ``progress<slot>`` after every iteration, so that the driver can time its signals;
- ``ledger<slot>.<incarnation>.pt`` after every iteration (with ``--timings`` also after every F):
  its F ledger (iteration, home, micro-batch, stage of every F it ran), its losses, the epoch it
  joined in and the membership changes it saw, which is what remains of a rank killed by SIGKILL
  (saved once right after the join too);
- ``<slot>.<incarnation>.pt`` whatever other way it ends (finished, or left after a SIGTERM): the
  same and its parameters and optimizer state.

Options that the driver sets:

- ``--trap SLOT:POINT:ITERATION[:until-failure]``: the first process of the slot parks there
  (:mod:`ds_recycle.testing.faults`);
- ``--trap-files``: traps are read from ``trap<slot>`` at every boundary, in any incarnation (a
  parked rank that gets SIGTERM, a leave, stops parking and finishes its iteration unless the trap
  says ``stay``);
- ``--gate``: a respawned process waits while ``gate<slot>`` exists, before it imports anything heavy
  (the driver chooses when a worker comes back, and its import does not load the CPU meanwhile);
- ``--timings``: the records also hold every ``train_batch`` call's start and end, the iterations
  finished, the epoch and its plan, and when the process started and joined; the ledger is saved
  after every F too (a rank killed at a random moment may have done all its work of an iteration
  that the survivors then commit);
- ``--data dataset --helpers``: a map-style ``training_data`` and helper processes beside the
  engine (two DataLoader workers and a forked process), as training scripts have;
- ``--save-every N``: the script saves ``engine.save_checkpoint(out/saves)`` after every N-th
  iteration, as a DeepSpeed script does;
- ``hold`` (a file): wait at the boundary after that many iterations (the driver's pacing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

PROCESS_START = time.time()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--trap", action="append", default=[], help="SLOT:POINT:ITERATION[:until-failure]: park at POINT"
    )
    parser.add_argument("--trap-files", action="store_true", help="traps from out/trap<slot>, in any incarnation")
    parser.add_argument("--gate", action="store_true", help="a respawned process waits while out/gate<slot> exists")
    parser.add_argument("--timings", action="store_true", help="record every call's times; save after every F")
    parser.add_argument(
        "--data", choices=["provider", "dataset"], default="provider", help="training_data: a provider or a dataset"
    )
    parser.add_argument("--helpers", action="store_true", help="start helper processes, as a script would")
    parser.add_argument(
        "--save-every", type=int, default=0, help="engine.save_checkpoint(out/saves) after every N-th iteration"
    )
    return parser.parse_args()


class SavedLedger(list):
    """The F ledger, saved again after every entry (entries of iterations that a recovery re-ran
    are voided by the checker)."""

    def __init__(self, save) -> None:
        super().__init__()
        self.save = save

    def append(self, entry) -> None:
        super().append(entry)
        self.save()


def record_call(calls: list[dict], engine, began: float) -> None:
    """One ``train_batch`` call: its wall times, the iterations finished, the epoch (and, for the
    epoch's first call, its plan)."""
    epoch = engine.grid.membership.epoch
    calls.append({"start": began, "end": time.time(), "done": engine.global_steps, "epoch": epoch})
    if len(calls) == 1 or calls[-2]["epoch"] != epoch:
        calls[-1]["plan"] = vars(engine.plan_summary())


def main() -> None:
    args = parse_args()
    from ds_recycle.testing.rank import wait_at_gate

    if args.gate:
        wait_at_gate(args.out)
    started = time.time()

    import json

    from ds_recycle.testing.faults import FaultPlan, Trap
    from ds_recycle.testing.rank import (
        build_engine,
        parameter_digest,
        report_progress,
        save_atomically,
        slot_and_incarnation,
        start_helpers,
        start_rank,
        wait_while_held,
    )

    start_rank()
    slot, incarnation = slot_and_incarnation()
    engine = build_engine(args.pp, args.optimizer, json.loads(args.config.read_text()), args.data)
    timing = {"process_start": PROCESS_START, "started": started, "joined": time.time()}
    joined_epoch = engine.grid.membership.epoch
    helpers = start_helpers(args.out, slot, incarnation) if args.helpers else None
    losses: dict[int, float] = {}
    digests: dict[int, list[float]] = {}
    calls: list[dict] = []

    def snapshot() -> dict:
        changes = [{**vars(c), "plan": None if c.plan is None else vars(c.plan)} for c in engine.membership_changes]
        record = {"ledger": list(engine.forward_ledger), "losses": dict(losses), "changes": changes}
        record["digests"] = dict(digests)
        record["joined_epoch"] = joined_epoch
        return {**record, "calls": list(calls), **timing} if args.timings else record

    def save() -> None:
        save_atomically(snapshot(), args.out / f"ledger{slot}.{incarnation}.pt")

    save()  # a process killed before its first F still says which epoch it joined in
    if args.timings:
        engine.forward_ledger = SavedLedger(save)
    traps = [trap for s, trap in map(Trap.parse, args.trap) if s == slot] if incarnation == 0 else []
    faults = FaultPlan(engine, args.out, slot, save, traps, trap_file=args.trap_files)
    record = {"slot": slot, "incarnation": incarnation, "worker": engine.worker, "joined_at": engine.global_steps}
    timing["joined_at"] = engine.global_steps
    try:
        while engine.global_steps < args.steps:
            wait_while_held(args.out / "hold", lambda: engine.global_steps)
            faults.refresh()
            if helpers is not None:
                next(helpers)  # the script's own use of its helper processes
            began = time.time()
            loss = float(engine.train_batch())
            # After a recovery the call may have re-run an earlier iteration: it returns the loss of
            # the iteration it finished last.
            losses[engine.global_steps - 1] = loss
            digests[engine.global_steps] = parameter_digest(engine)
            if args.timings:
                record_call(calls, engine, began)
            if args.save_every and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(str(args.out / "saves"))  # a DeepSpeed script's own checkpoint
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
