"""Helpers for the multi-process engine tests: launch the worker, load what the ranks wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES

WORKER = Path(__file__).with_name("worker.py")


def run_ranks(
    tmp_path: Path, pp: int, dp: int, runs: list[dict], steps: int = 5, timeout: float = 300, backend: str = "gloo"
) -> dict:
    """Launch pp*dp ranks that execute ``runs``; return {run name: [rank dumps]} (``backend``
    ``nccl``: on CUDA, each rank exec'd rather than forked from a preloaded process)."""
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps(runs))
    out = tmp_path / "out"
    results = launch(
        [str(WORKER), "--pp", str(pp), "--steps", str(steps), "--runs", str(runs_file), "--out", str(out)],
        world_size=pp * dp,
        timeout=timeout,
        log_dir=tmp_path / "logs",
        preload=PRELOAD_MODULES if backend == "gloo" else (),
        membership=False,  # the worker runs stock and ReCycle engines in one process: no coordinator
        backend=backend,
    )
    failed = [r for r in results if not r.ok]
    if failed:
        r = failed[0]
        state = "timed out and was killed" if r.returncode is None else f"exited with {r.returncode}"
        sys.stderr.write(r.log[-6000:])
        raise AssertionError(f"rank {r.rank} {state}; its log is above")
    return {
        run["name"]: [torch.load(out / run["name"] / f"rank{rank}.pt", map_location="cpu") for rank in range(pp * dp)]
        for run in runs
    }


def assert_bitwise_equal(expected: list[dict], actual: list[dict]) -> None:
    for want, got in zip(expected, actual, strict=True):
        assert got["losses"] == want["losses"], f"rank {got['rank']}: losses {got['losses']} != {want['losses']}"
        assert got["eval_loss"] == want["eval_loss"], f"rank {got['rank']}: eval loss differs"
        assert want["params"].keys() == got["params"].keys()
        for name, value in want["params"].items():
            diff = (got["params"][name] - value).abs().max().item()
            assert torch.equal(got["params"][name], value), f"rank {got['rank']} {name}: max |diff| {diff:.3e}"
