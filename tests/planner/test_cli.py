"""``ds-recycle plan``: in-process runs of main() and one real run of the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_recycle.cli import main
from ds_recycle.planner.plan import Plan
from ds_recycle.planner.validator import validate

ISSUE_KEYS = {
    "pipelines",
    "stages",
    "microbatches",
    "failed",
    "costs",
    "memory_cap",
    "workers",
    "iteration_time",
    "steady_state_period",
    "lower_bound",
    "solver",
    "solve_seconds",
}
BASE = ["plan", "--pipelines", "3", "--stages", "4", "--microbatches", "4"]


def test_plan_prints_gantt_and_figures_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert main([*BASE, "--fail", "0:1", "--costs", "1,2,1", "--comm", "0.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for figure in ("iteration time:", "lower bound:", "ratio:", "steady-state period:", "solve time:", "gap:"):
        assert figure in text
    assert "p0 s1" in text and "failed" in text  # the dead worker has its own row
    data = json.loads(out.read_text())
    assert ISSUE_KEYS <= set(data)
    assert data["failed"] == [[0, 1]]
    assert data["costs"]["B"] == [2.0] * 4 and data["costs"]["comm"] == 0.5
    assert set(data["costs"]) >= {"F", "B", "W", "comm", "step"}
    assert "0,1" not in data["workers"] and "1,1" in data["workers"]
    assert set(data["workers"]["1,1"][0]) >= {"op", "home", "mb", "start", "end"}
    plan = Plan.from_dict(data)
    validate(plan)
    ratio_line = next(line for line in text.splitlines() if line.startswith("ratio:"))
    assert float(ratio_line.split()[-1]) == pytest.approx(plan.iteration_time / plan.lower_bound, abs=1e-4)


def test_plan_with_milp_and_a_yaml_cost_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cost_file = tmp_path / "costs.yaml"
    cost_file.write_text("F: [1, 1, 2]\nB: [1, 2, 2]\nW: [1, 1, 1]\ncomm: 0.25\nstep: 1\n")
    out = tmp_path / "plan.json"
    args = ["plan", "-D", "2", "-P", "3", "-m", "3", "--fail", "1:2", "--cost-file", str(cost_file)]
    assert main([*args, "--solver", "milp", "--time-limit", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["solver"] == "milp" and data["costs"]["F"] == [1, 1, 2] and data["costs"]["step"] == 1
    assert "gap:" in capsys.readouterr().out
    validate(Plan.from_dict(data))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fail", "3:1"], "outside the grid"),
        (["--fail", "0:4"], "s in 0..3"),
        (["--fail", "zero:one"], "malformed"),
        (["--fail", "1-2"], "expected p:s"),
        (["--costs", "1,-1,1"], "negative cost"),
        (["--costs", "1,1"], "three numbers"),
        (["--comm", "-0.5"], "negative cost comm"),
        (["--memory-cap", "0"], "--memory-cap"),
        (["--cost-file", "/nonexistent/costs.json"], "no such file"),
        (["--fail", "0:2", "--fail", "1:2", "--fail", "2:2"], "needs checkpoint fallback"),
        (["--fail", "0:2,1:2,2:2"], "needs checkpoint fallback"),
        (["--solver", "gurobi"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main([*BASE, *extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"F": [1, 1, 1, 1], "B": [1, 1, 1, 1]}', "missing key 'W'"),
        ('{"F": [1, 1], "B": [1, 1, 1, 1], "W": [1, 1, 1, 1]}', "list of 4 numbers"),
        ('{"F": [1, 1, 1, -1], "B": [1, 1, 1, 1], "W": [1, 1, 1, 1]}', "negative cost F[3]"),
        ('{"F": 1, "B": 1, "W": 1, "latency": 2}', "unknown keys"),
        # the fuzz test's find: the message says what is expected, whatever YAML's first line says
        ("F: [1, 1\nB: {", "neither valid JSON nor valid YAML (while parsing a flow sequence); expected a mapping"),
        ('{"F": [1, 1, 1, "x"], "B": [1, 1, 1, 1], "W": [1, 1, 1, 1]}', "is not a number"),
    ],
)
def test_bad_cost_files(tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "costs.txt"
    path.write_text(content)
    assert main([*BASE, "--cost-file", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_missing_required_argument_and_unimplemented_subcommands(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--pipelines", "2"]) == 2
    assert "--stages" in capsys.readouterr().err
    assert main(["simulate"]) == 2  # implemented (issue 8): its required arguments are named
    assert "required" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_console_script_writes_json_and_png(tmp_path: Path) -> None:
    script = shutil.which("ds-recycle") or str(Path(sys.executable).with_name("ds-recycle"))
    assert Path(script).exists(), "the ds-recycle console script is not installed"
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    result = subprocess.run(
        [script, *BASE, "--fail", "2:3", "--json", str(out_json), "--png", str(out_png)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert result.returncode == 0, result.stderr
    assert "iteration time:" in result.stdout
    assert ISSUE_KEYS <= set(json.loads(out_json.read_text()))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
