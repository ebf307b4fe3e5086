"""The NCCL failure path on real processes (``ds_recycle.testing.nccl_abort``): a survivor inside an
all-reduce or a receive that a SIGKILLed or SIGSTOPped peer never joins stops waiting within 500 ms
of its failure flag, aborts its communicators in under a second, and finds its CUDA stream clear
afterwards. The GPU tests are skipped where torch sees no CUDA device (CI); ``scripts/gpu_check.sh``
runs them on a GPU. The gloo run (CPU) checks the harness itself and the waits' flag path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAILURE_SCENARIOS = ("all-reduce", "recv", "sigstop")
FLAG_TO_END_MS = 500.0
ABORT_MS = 1000.0

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu_check.sh runs it on a GPU"
)


def run_harness(out: Path, *args: str, timeout: float) -> tuple[dict, str]:
    """The harness's JSON report and its printed lines."""
    command = [sys.executable, "-m", "ds_recycle.testing.nccl_abort", *args, "--json", str(out)]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the harness ran past {timeout:.0f} s:\n{error.stdout or ''}{error.stderr or ''}")
    output = result.stdout + result.stderr
    print(output)
    if not out.exists():
        pytest.fail(f"the harness wrote no report (exit {result.returncode}):\n{output}")
    return json.loads(out.read_text()), output


def failure_scenarios(report: dict, output: str) -> list[dict]:
    scenarios = {s["name"]: s for s in report["scenarios"]}
    for name in FAILURE_SCENARIOS:
        assert name in scenarios, f"no {name} scenario in the report:\n{output}"
        assert scenarios[name]["error"] is None, f"{name}: {scenarios[name]['error']}\n{output}"
        assert scenarios[name]["survivors"], f"{name}: no survivor reported:\n{output}"
    return [scenarios[name] for name in FAILURE_SCENARIOS]


def assert_waits_ended_by_the_flag(scenarios: list[dict], output: str) -> None:
    for scenario in scenarios:
        for survivor in scenario["survivors"]:
            late = survivor["flag_to_end_ms"]
            where = f"{scenario['name']}, rank {survivor['rank']}"
            assert late is not None, f"{where}: the flag never came\n{output}"
            assert late <= FLAG_TO_END_MS, f"{where}: the wait ended {late:.0f} ms after the flag\n{output}"


@pytest.fixture(scope="module")
def nccl_report(tmp_path_factory) -> tuple[dict, str]:
    return run_harness(tmp_path_factory.mktemp("nccl_abort") / "report.json", timeout=180)


@pytest.mark.gpu
@needs_cuda
def test_survivors_stop_waiting_within_500_ms_of_the_flag_on_nccl(nccl_report):
    report, output = nccl_report
    assert report["skipped"] is None, output
    assert_waits_ended_by_the_flag(failure_scenarios(report, output), output)


@pytest.mark.gpu
@needs_cuda
def test_the_abort_takes_under_a_second_and_leaves_the_stream_clear(nccl_report):
    report, output = nccl_report
    for scenario in failure_scenarios(report, output):
        for survivor in scenario["survivors"]:
            where = f"{scenario['name']}, rank {survivor['rank']}"
            assert survivor["abort_error"] is None, f"{where}: {survivor['abort_error']}\n{output}"
            assert survivor["abort_ms"] < ABORT_MS, f"{where}: the abort took {survivor['abort_ms']:.0f} ms\n{output}"
            assert survivor["stream"] == "clear", f"{where}: stream {survivor['stream']}\n{output}"


@pytest.mark.gpu
@needs_cuda
def test_survivors_make_a_fresh_world_after_the_abort(nccl_report):
    report, output = nccl_report
    after = next(s for s in report["scenarios"] if s["name"] == "all-reduce")
    assert after["comms_error"] is None, f"{after['comms_error']}\n{output}"
    for costs in after["comms"]:
        assert "error" not in costs, f"rank {costs['rank']}: {costs['error']}\n{output}"
        assert "error" not in costs["fresh"], f"rank {costs['rank']}: {costs['fresh']['error']}\n{output}"


@pytest.mark.multiprocess
def test_the_harness_on_gloo_ends_every_survivors_wait_by_the_flag_at_the_latest(tmp_path):
    """gloo on CPU: a SIGKILLed peer's closed sockets may end a survivor's wait before the flag (a
    negative time); a SIGSTOPped one's never do, so there the flag must end it."""
    report, output = run_harness(tmp_path / "report.json", "--backend", "gloo", timeout=60)
    scenarios = failure_scenarios(report, output)
    assert_waits_ended_by_the_flag(scenarios, output)
    stopped = next(s for s in scenarios if s["name"] == "sigstop")
    assert all(s["ended_by"] == "flag" for s in stopped["survivors"]), output
