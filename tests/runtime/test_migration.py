"""Migration in a real ``ds-recycle launch`` job: two workers of one stage SIGKILLed and given up
(``--max-restarts 0``) leave that stage with one worker of three; a survivor of the other stage
moves into one of the dead slots through the leave and join paths, and the job ends with every
parameter and optimizer state equal to a fault-free run and every micro-batch counted once.

Grid: pp = 2, dp = 3; slot = stage * 3 + pipeline. Slots 4 and 5 (stage 1) are killed; the rule
moves slot 1 (worker (1, 0)) into slot 4 (worker (1, 1)): 2 live workers per stage after it.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ds_recycle.runtime.shared.records import JOIN, MOVE
from ds_recycle.testing.jobs import (
    Job,
    assert_every_microbatch_once,
    assert_final_states,
    fault_free,
    final_states,
    job_config,
)

pytestmark = pytest.mark.multiprocess

PP, DP, STEPS = 2, 3, 16
KILLED = [4, 5]
MOVER = 1


def start(tmp_path) -> Job:
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam", launcher_args=["--max-restarts", "0"], timeout=180)
    job.traps = [f"{s}:F:2" for s in KILLED]
    return job.start()


ATOL = 5e-7
"""Three pipelines re-routed two ways sum each stage's micro-batch gradients in another order than
the fault-free run; through 16 Adam steps that moves the tied embedding by up to 2.8e-7 (measured;
every other parameter by at most 1.2e-7). Replicas of a stage stay bitwise equal to each other."""


def check_against_fault_free(job: Job, reference: dict[int, dict], finishing: list[int]) -> None:
    records = assert_final_states(job, {s: reference[s] for s in finishing}, STEPS, atol=ATOL)
    finished = final_states(records)
    for s in finishing:  # the state a joiner copied, and every step since, equal its stage's replicas
        replica = next(r for r in finishing if r // DP == s // DP)
        for name, value in finished[replica]["params"].items():
            assert torch.equal(finished[s]["params"][name], value), f"slot {s} {name} differs from slot {replica}"
    assert_every_microbatch_once(job, records, STEPS)


def kill_two_of_stage_one(job: Job) -> tuple[int, int]:
    """SIGKILL slots 4 and 5 at their first F of iteration 2, hold the job once the move is decided
    and the mover's device starts as the retired slot it moves into; returns the iteration the
    survivors were held at, and that slot. (Either killed slot is a right target: the lowest member
    proposes into a slot retired when it looks, and the two retirements race.)"""
    for s in KILLED:
        job.signal_when_trapped(s)
    for s in KILLED:
        job.wait_for_event("retired", slot=s)
    target = job.wait_for_event("accepted", kind=MOVE, slot=MOVER)["target"]
    assert target in KILLED, f"moved into slot {target}, which was not retired"
    moved = job.wait_for_event("moved", slot=MOVER, target=target)
    assert moved["local_rank"] == MOVER
    held = max(job.progress(s) for s in (0, 2, 3))
    job.hold(held)
    return held, target


def test_two_workers_of_one_stage_lost_a_survivor_moves_and_training_equals_fault_free(tmp_path, tmp_path_factory):
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = start(tmp_path)
    try:
        held, target = kill_two_of_stage_one(job)
        job.wait_for_event("accepted", kind=JOIN, slot=target)
        job.hold(None)
        job.wait_until(lambda: job.progress(target) > held, f"the mover's device to train as slot {target}")
        assert job.finish() == 0, job.log_tail()
    except BaseException:
        job.kill()
        raise
    assert job.count_in_rank_logs(rf"proposes to move worker \(1, 0\) \(slot {MOVER}\) into retired slot {target}") == 1
    assert job.count_in_rank_logs(rf"slot {MOVER} .* left the job .* re-joins as slot {target}") == 1
    assert job.count(rf"rank {MOVER} moved: rank {target} starts on its device \(local rank {MOVER}\)") == 1
    assert job.count_events("started", slot=MOVER) == 1  # the mover's slot is not respawned
    check_against_fault_free(job, reference, finishing=[0, 2, 3, target])


def test_a_move_whose_new_process_dies_before_it_joined_is_recovered(tmp_path, tmp_path_factory):
    """The mover left; the process started for its target dies before its join: that is a joiner's
    failure like any other (nothing to recover among the members), the target is given up again,
    and with one live worker per stage left to spare none, no further move is proposed."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = start(tmp_path)
    try:
        _, target = kill_two_of_stage_one(job)
        started = job.wait_for_event("started", slot=target, incarnation=1)
        os.kill(started["pid"], signal.SIGKILL)
        job.wait_for_event("retired", 2, slot=target)
        job.hold(None)
        assert job.finish() == 0, job.log_tail()
    except BaseException:
        job.kill()
        raise
    assert job.count_events("accepted", kind=MOVE) == 1
    assert job.count_in_rank_logs(r"retired slots \[1, 4, 5\]: no move pays") >= 1
    check_against_fault_free(job, reference, finishing=[0, 2, 3])
