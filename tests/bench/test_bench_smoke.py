"""The benchmarks that start real jobs run at a smoke size, so that a bench that breaks fails the
suite (their full sizes are run by hand; their outputs sit next to them in bench/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("script", ["engine_vs_stock.py", "multinode.py"])
def test_bench_runs_at_smoke_size(script):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
