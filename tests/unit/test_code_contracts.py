"""The code's contracts, checked by the suite (so by CI): the import contract of pyproject.toml
(``lint-imports``: the layers of ds_recycle, no cycles, the engine handed its runtime), ``ruff check``
and ``ruff format --check``. Each runs as the developer would run it, from the repository root with the
venv's own executables; a failure prints the tool's output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_SECONDS = 120


def run_tool(name: str, *args: str) -> None:
    __tracebackhide__ = True  # a failure shows the tool's output, not this function
    executable = BIN / name
    command = f"{name} {' '.join(args)}"
    if not executable.exists():
        pytest.fail(f"{executable} is missing: install the test extra (bash scripts/bootstrap.sh)")
    try:
        result = subprocess.run(
            [str(executable), *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired as error:
        output = f"{error.stdout or ''}{error.stderr or ''}"
        pytest.fail(f"`{command}` did not finish within {TIMEOUT_SECONDS} s:\n{output}")
    if result.returncode != 0:
        pytest.fail(f"`{command}` exited {result.returncode}:\n{result.stdout}{result.stderr}")


def test_the_import_contract_is_kept():
    # --no-cache: the verdict of this tree, not of a cache that another checkout or run left behind
    run_tool("lint-imports", "--no-cache")


def test_ruff_check_passes():
    run_tool("ruff", "check", ".")


def test_ruff_format_leaves_every_file_as_it_is():
    run_tool("ruff", "format", "--check", ".")
