"""Every benchmark runs at its smoke size, so that a bench that breaks fails the suite (their full
sizes are run by hand; their outputs sit next to them in bench/). The ones that start real jobs are
marked ``multiprocess``; those among them whose smoke runs check no timing are also marked
``beside``: the suite runs them in the pure tests' lane (scripts/test.sh)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SMOKE = {
    "backward_split.py": ["--quick"],
    "planner.py": ["--smoke"],
    "paper_study.py": ["--smoke"],
    "engine_vs_stock.py": ["--smoke"],
    "failures.py": ["--smoke"],
    "fault_campaign.py": ["--smoke"],
    "multinode.py": ["--smoke"],
    "evaluation.py": ["--smoke"],
    "measured_costs.py": ["--smoke"],
    "control_plane.py": ["--smoke"],
    "ettr.py": ["--smoke"],
    "gpu_costs.py": ["--smoke"],
    "etcd_ops.py": ["--smoke"],
}
MULTIPROCESS = {
    "engine_vs_stock.py",
    "failures.py",
    "fault_campaign.py",
    "multinode.py",
    "evaluation.py",
    "measured_costs.py",
    "control_plane.py",
}
BESIDE = {"engine_vs_stock.py", "failures.py", "evaluation.py", "measured_costs.py", "control_plane.py"}
"""Their smoke runs only check that they run to the end (the others have a deadline to meet)."""
TIMEOUT = 300


def run_bench(script: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *SMOKE[script]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("script", sorted(set(SMOKE) - MULTIPROCESS))
def test_bench_runs_at_smoke_size(script):
    run_bench(script)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=[pytest.mark.beside] if s in BESIDE else []) for s in sorted(MULTIPROCESS)]
)
def test_bench_that_starts_jobs_runs_at_smoke_size(script):
    run_bench(script)


def test_every_bench_has_a_smoke_size():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(SMOKE)


def test_benches_import_no_test_module():
    """The harness they share with the tests is ds_recycle.testing; bench/ puts nothing on sys.path."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & test_modules, f"{path.name} imports {imported & test_modules}"
        assert "sys.path" not in path.read_text(), f"{path.name} changes sys.path"
