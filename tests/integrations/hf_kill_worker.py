"""examples/hf_trainer_llama.py with one rank SIGKILLed: rank ``HF_KILL_RANK`` kills itself
``HF_KILL_DELAY`` seconds after Trainer step ``HF_KILL_AFTER`` ends (a callback added to every
``RecycleTrainer``). Same arguments as the example."""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from ds_recycle.integrations.hf_trainer import RecycleTrainer

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


def main() -> None:
    init = RecycleTrainer.__init__

    def with_kill(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(KillAfterStep())

    RecycleTrainer.__init__ = with_kill
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
