"""Every example survives its own README command with one kill and a re-join, at a small size.

examples/failure_demo.py runs examples/train_gpt.py under ``ds-recycle launch --respawn``, SIGKILLs a
worker mid-iteration from outside, lets its respawn re-join, and compares with a fault-free run (its
exit code is 0 only when the job survived and ended with the fault-free parameters).
examples/hf_trainer_llama.py is run the same way by
tests/integrations/test_hf_trainer.py::test_a_killed_rank_rejoins_and_the_trainer_takes_up_the_job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


def test_the_failure_demo_survives_a_kill_and_the_worker_rejoins(tmp_path):
    out = tmp_path / "demo"
    command = [sys.executable, str(ROOT / "examples" / "failure_demo.py"), "--out", str(out)]
    command += ["--steps", "30", "--kill-at", "8"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MPLBACKEND": "Agg"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "failed [(1, 1)]" in done.stdout and "joined [(1, 1)]" in done.stdout, done.stdout[-6000:]
    assert json.loads((out / "summary.json").read_text()), "the demo writes its summary"
    assert (out / "demo.png").stat().st_size > 0
