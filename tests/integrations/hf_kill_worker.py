"""examples/hf_trainer_llama.py with a callback added to every ``RecycleTrainer``, same arguments.

- ``HF_KILL_RANK``: rank ``HF_KILL_RANK`` kills itself ``HF_KILL_DELAY`` seconds after Trainer step
  ``HF_KILL_AFTER`` ends.
- ``HF_PROGRESS_DIR``: each rank writes its Trainer step to ``progress<rank>`` after every step, and
  waits at the step's end while ``hold`` there names a step it has reached (the test's pacing: a
  respawned rank re-joins before the job ends), as ds_recycle/testing/worker.py does.
- ``HF_TRAP``: ``SLOT:POINT:ITERATION`` (ds_recycle/testing/faults.py): the first process of the slot
  parks there, writing ``trapped<slot>`` in ``HF_PROGRESS_DIR``, for the test's signal.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from ds_recycle.integrations.hf_trainer import RecycleTrainer
from ds_recycle.testing.faults import FaultPlan, Trap
from ds_recycle.testing.rank import report_progress, slot_and_incarnation, wait_while_held

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_llama.py"


class KillAfterStep(TrainerCallback):
    def __init__(self) -> None:
        self.rank = int(os.environ["HF_KILL_RANK"])
        self.after = int(os.environ["HF_KILL_AFTER"])
        self.delay = float(os.environ.get("HF_KILL_DELAY", "0"))

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ["RANK"]) == self.rank and state.global_step == self.after:
            time.sleep(self.delay)
            os.kill(os.getpid(), signal.SIGKILL)


class ProgressAndHold(TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.rank = int(os.environ["RANK"])

    def on_step_end(self, args, state, control, **kwargs):
        report_progress(self.out, self.rank, state.global_step)
        wait_while_held(self.out / "hold", lambda: state.global_step, period=0.01)


def trapped_engine(start):
    """``RecycleTrainer._start_engine`` that installs ``HF_TRAP`` in the first process of its slot."""

    def start_engine(self, max_steps: int) -> None:
        start(self, max_steps)
        slot, trap = Trap.parse(os.environ["HF_TRAP"])
        if slot_and_incarnation() == (slot, 0):
            FaultPlan(self.engine, Path(os.environ["HF_PROGRESS_DIR"]), slot, lambda: None, [trap])

    return start_engine


def main() -> None:
    init = RecycleTrainer.__init__
    if "HF_TRAP" in os.environ:
        RecycleTrainer._start_engine = trapped_engine(RecycleTrainer._start_engine)

    def with_callbacks(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "HF_KILL_RANK" in os.environ:
            self.add_callback(KillAfterStep())
        if "HF_PROGRESS_DIR" in os.environ:
            self.add_callback(ProgressAndHold(Path(os.environ["HF_PROGRESS_DIR"])))

    RecycleTrainer.__init__ = with_callbacks
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
