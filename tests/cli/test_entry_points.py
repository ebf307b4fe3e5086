"""``python -m ds_recycle.cli`` and the ``ds-recycle`` script are one program: for every subcommand
a bad argument gives the same one-line error and exit code both ways, whether argparse refuses it
or the command's own checks do (``python -m`` once ended those in a traceback)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ds_recycle
from ds_recycle.cli import COMMANDS

BAD = {
    "plan": [
        (["-D", "2", "-P", "3", "-m", "0"], "--microbatches"),  # argparse
        (["-D", "2", "-P", "3", "-m", "4", "--fail", "0:0,1:0"], "--fail"),  # the command: no survivor
        (["-D", "2", "-P", "3", "-m", "4", "--png", "chart.jpg"], "--png"),  # the outputs
    ],
    "simulate": [
        (["sweep", "--model", "350M", "-D", "2", "-P", "2", "-m", "nan"], "--microbatches"),
        (["sweep", "--model", "350M", "-D", "2", "-P", "2", "-m", "4", "--trace", "x"], "--trace"),
        (["trace", "--model", "350M", "-P", "8", "-m", "4", "--trace", "no-such-trace"], "--trace"),
    ],
    "coordinator": [
        (["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1"], "--nnodes"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:0"], "--rdzv-endpoint"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1", "--check-in-timeout", "0"], "--check-in"),
    ],
    "status": [
        (["--rdzv-endpoint", "h"], "--rdzv-endpoint"),  # the command
        (["--rdzv-endpoint", "h:1", "--timeout", "0"], "--timeout"),  # argparse
        ([], "--rdzv-endpoint"),
    ],
    "launch": [
        (["--nproc", "x", "train.py"], "--nproc"),
        (["--nproc", "0", "train.py"], "--nproc"),
        (["--nproc", "2", "missing.py"], "SCRIPT"),
    ],
}
CASES = [(command, argv, mentions) for command, cases in BAD.items() for argv, mentions in cases]


def _script() -> str:
    """The console script of this interpreter's environment (else the one on PATH)."""
    script = Path(sys.executable).with_name("ds-recycle")
    found = str(script) if script.exists() else shutil.which("ds-recycle")
    assert found, "the ds-recycle console script is not installed"
    return found


def _run(program: list[str], argv: list[str], cwd: Path) -> tuple[int, str, str]:
    result = subprocess.run(
        [*program, *argv], capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, "MPLBACKEND": "Agg"}
    )
    return result.returncode, result.stdout, result.stderr


def test_every_command_has_bad_cases() -> None:
    assert sorted(BAD) == sorted(COMMANDS)


@pytest.mark.parametrize(
    ("command", "argv", "mentions"), CASES, ids=[f"{c}-{m}-{i}" for i, (c, _, m) in enumerate(CASES)]
)
def test_a_bad_argument_gives_the_same_line_both_ways(command: str, argv: list[str], mentions: str, tmp_path) -> None:
    (tmp_path / "train.py").write_text("import sys\nsys.exit(0)\n")
    as_module = _run([sys.executable, "-m", "ds_recycle.cli"], [command, *argv], tmp_path)
    as_script = _run([_script()], [command, *argv], tmp_path)
    assert as_module == as_script
    code, out, err = as_script
    assert code == 2 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ds-recycle {command}: error: ") and mentions in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_help_is_the_same_both_ways(tmp_path) -> None:
    as_module = _run([sys.executable, "-m", "ds_recycle.cli"], ["--help"], tmp_path)
    assert as_module == _run([_script()], ["--help"], tmp_path)
    assert as_module[0] == 0 and all(name in as_module[1] for name in COMMANDS)


def test_no_module_outside_the_cli_package_imports_it() -> None:
    """The command line sits on top: the study, the planner and the rest never import it."""
    root = Path(ds_recycle.__file__).parent
    offending = []
    for path in sorted(root.rglob("*.py")):
        if (root / "cli") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offending += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[:2] == ["ds_recycle", "cli"]]
    assert offending == []
