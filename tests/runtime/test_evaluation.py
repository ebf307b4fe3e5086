"""Evaluation over the live workers, under ``ds-recycle launch`` with a real SIGKILL.

2 stages x 2 pipelines. Every rank evaluates fault-free; then the last-stage worker of pipeline 1
kills itself while the others are inside their next evaluation. They recover it as a failure
during training is recovered, run it again on the forward-only plan without the dead worker (its
pipeline's last stage runs on pipeline 0's), and get the fault-free loss: the parameters did not
change, and every micro-batch was evaluated once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_recycle.runtime.node.launcher import LaunchConfig, Launcher
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import ds_config

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("eval_worker.py")
M = 4
VICTIM = 3
"""Slot 3 is worker (pipeline 1, stage 1): DeepSpeed's pipe-data topology is stage-major."""


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("eval")
    config = ds_config(M, 0.0, {"enabled": True, "emulate_timing": {"F": 10, "B": 10, "W": 10}})
    argv = [str(WORKER), "--out", str(tmp), "--config", json.dumps(config), "--victim", str(VICTIM)]
    lines: list[str] = []
    (tmp / "logs").mkdir()
    launcher = Launcher(
        LaunchConfig(argv=argv, nproc=4, timeout=180, log_dir=tmp / "logs", preload=PRELOAD_MODULES), echo=lines.append
    )
    code = launcher.run()
    codes = [r.returncode for r in launcher.results()]
    if code != 0 or codes != [0, -9, 0, -9]:
        for path in sorted((tmp / "logs").glob("*.log")):
            sys.stderr.write(f"--- {path.name} ---\n" + path.read_text()[-4000:])
        raise AssertionError(f"launcher exited {code}, ranks {codes}:\n" + "\n".join(lines[-40:]))
    return {slot: torch.load(tmp / f"{slot}.pt", weights_only=False) for slot in range(3)}


def test_fault_free_eval_is_the_same_from_a_source_or_an_iterator(job):
    losses = {r["fault_free"]["loss"] for r in job.values()} | {r["fault_free_iterator"]["loss"] for r in job.values()}
    assert len(losses) == 1, f"every rank returns the one mean loss: {losses}"
    assert all(r["fault_free"]["shape"] == () for r in job.values())


def test_a_failure_during_evaluation_is_recovered_and_the_batch_run_again(job):
    for record in job.values():
        interrupted = record["interrupted"]
        assert interrupted["attempts"] == 2, "the first run was interrupted by the SIGKILL"
        assert interrupted["failed"] == ((1, 1),)
        torch.testing.assert_close(interrupted["loss"], record["fault_free"]["loss"], rtol=1e-6, atol=0)


def test_degraded_evaluation_equals_fault_free_and_sees_each_micro_batch_once(job):
    ran: dict[tuple[int, int, int], int] = {}
    for record in job.values():
        degraded = record["degraded"]
        assert degraded["attempts"] == 1 and degraded["failed"] == ((1, 1),)
        torch.testing.assert_close(degraded["loss"], record["fault_free"]["loss"], rtol=1e-6, atol=0)
        for home, mb in degraded["forwards"]:
            key = (home, mb, record["stage"])
            ran[key] = ran.get(key, 0) + 1
    assert ran == {(h, k, s): 1 for h in range(2) for k in range(M) for s in range(2)}
    for record in job.values():
        degraded, fault_free = record["degraded_3"], record["fault_free_3"]
        assert len(fault_free["forwards"]) == 3 and degraded["failed"] == ((1, 1),)
        torch.testing.assert_close(degraded["loss"], fault_free["loss"], rtol=1e-6, atol=0)
        assert degraded["loss"] != record["degraded"]["loss"], "num_micro_batches=3 evaluates fewer micro-batches"
    stand_in = job[2]  # slot 2, worker (0, 1), runs pipeline 1's last stage too
    assert sorted(stand_in["degraded"]["forwards"]) == [(h, k) for h in range(2) for k in range(M)]


def test_an_iterator_cannot_feed_a_missing_last_stage_and_training_goes_on(job):
    for record in job.values():
        assert "pass a callable (home, mb) -> batch" in record["iterator_refused"]
        assert record["global_steps"] == 3
        assert torch.isfinite(torch.tensor(record["trained_after"]))


def test_a_failure_after_a_peer_finished_the_batch_takes_its_loss(job):
    """Slot 1 dies right after it finished an evaluation; slot 0, still inside it, is interrupted:
    it takes the finished batch's loss from the job's store instead of running it again (which the
    others, past it, would never join), and both survivors train and evaluate on together."""
    late, root = job[0], job[2]
    assert late["after_commit"]["from_peer"] and late["after_commit"]["attempts"] == 1
    assert late["after_commit"]["loss"] == root["after_commit"]["loss"]
    for record in (late, root):
        assert record["final_steps"] == 4 and torch.isfinite(torch.tensor(record["trained_last"]))
        assert record["final"]["failed"] == ((1, 0), (1, 1)) and record["final"]["attempts"] == 1
    assert late["final"]["loss"] == root["final"]["loss"]
