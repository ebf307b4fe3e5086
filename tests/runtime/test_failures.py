"""Unplanned failures in real ``ds-recycle launch`` jobs on gloo: a rank SIGKILLed or SIGSTOPped
from this test process at a chosen instruction, then respawned by the launcher and re-joined.

A rank is told (``--trap``) to park at one point of one iteration: the first F, B or W, the
data-parallel all-reduce, right after its stage's optimizer step, or at the start of a recovery.
The test sends the signal once it is parked there, so the failure lands exactly at that point while
its peers wait on it. Each job ends with every parameter and optimizer state equal to a fault-free
run, the same losses, and an F ledger (killed ranks included) with every micro-batch of every
iteration exactly once per stage.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import pytest

from ds_recycle.runtime.shared.keys import JOIN_GIVEN_UP_EXIT_CODE
from ds_recycle.testing.jobs import (
    Job,
    assert_final_states,
    assert_same_as_fault_free,
    fault_free,
    hold_degraded,
    job_config,
    rejoin,
    slot,
    wait_until_held,
)

pytestmark = pytest.mark.multiprocess

STEPS = 24
HANG_TIMEOUT = "3"
"""--heartbeat-min-timeout for these jobs: a SIGSTOPped rank is declared failed after 3 s."""


def start_with_faults(job: Job, faults: list[tuple[list[int], int]]) -> None:
    """Start ``job`` and :func:`run_faults` on it; on any error kill what it started."""
    job.start()
    try:
        run_faults(job, faults)
    except BaseException:
        job.kill()
        raise


def run_faults(job: Job, faults: list[tuple[list[int], int]]) -> None:
    """``faults``: (slots, signal) in order; each slot is parked at its trap when signalled, then
    re-joins after the survivors ran a few iterations on the adapted plan. A trap must lie beyond
    the previous fault's re-join (about DEGRADED_ITERATIONS + 2 iterations after it): a rank parked
    early would stall the job while the test waits for the re-joined rank to train."""
    for slots, sig in faults:
        joins = {s: job.count_events("accepted", kind="join", slot=s) for s in slots}
        for s in slots:
            job.signal_when_trapped(s, sig)
        iteration = max(job.progress(s) for s in range(job.pp * job.dp))
        hold_degraded(job, iteration)
        for s in slots:
            job.wait_for_event("exited", slot=s, signal="SIGKILL")
        rejoin(job, slots, iteration, joins)


def kill_while_a_join_is_pending(job: Job, joiner: int, victim: int, wait_for_victim: Callable[[], None]) -> None:
    """Start ``job``; SIGKILL ``joiner`` at its trap; its respawn waits at its gate (a preloaded
    respawn asks at once, and its join could be decided at a boundary first) until
    ``wait_for_victim()`` returns, then asks to join; once the join is accepted, SIGKILL ``victim``
    and let it re-join after the survivors ran a few iterations."""
    job.worker_args = ["--gate"]
    gate = job.out / f"gate{joiner}"
    gate.touch()
    job.start()
    try:
        job.signal_when_trapped(joiner)
        wait_for_victim()
        gate.unlink()
        job.wait_for_event("accepted", kind="join", slot=joiner)
        os.kill(job.pids[victim], signal.SIGKILL)
        job.wait_for_event("published_failure", slot=victim)
        iteration = max(job.progress(s) for s in range(job.pp * job.dp))
        hold_degraded(job, iteration)
        job.wait_for_event("exited", slot=victim, signal="SIGKILL")
        rejoin(job, [victim], iteration, {victim: 0})
    except BaseException:
        job.kill()
        raise


def check(job: Job, reference: dict, faults: int) -> list[int]:
    """The job ended equal to the fault-free run; returns every survivor's distinct recovery
    latencies (ms from the failure)."""
    code = job.finish()
    assert code == 0, job.log_tail()
    logs = "\n".join(path.read_text() for path in sorted((job.tmp / "logs").glob("*.log")))
    recovered = sorted({int(ms) for ms in re.findall(r"recovered (\d+) ms after the failure", logs)})
    assert job.count(r"published failure of slot") >= faults
    print(f"{faults} failures; kill to recovered (ms, distinct values over the survivors): {recovered}")
    assert_same_as_fault_free(job, reference, STEPS)
    return recovered


@pytest.mark.parametrize(
    "optimizer,traps",
    [
        # the first stage during F, the last during B, the middle one during W
        ("adam", [(0, 0, "F", 3), (1, 2, "B", 10), (0, 1, "W", 17)]),
        # during the all-reduce, between the step and the end of the iteration, and a hang (SIGSTOP)
        ("sgd", [(1, 1, "allreduce", 3), (0, 2, "stepped", 10), (1, 0, "F", 17)]),
    ],
    ids=["F-B-W", "allreduce-stepped-sigstop"],
)
def test_a_killed_rank_is_survived_and_rejoins(tmp_path, tmp_path_factory, optimizer, traps):
    pp, dp = 3, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, optimizer)
    points = [f"{slot(dp, p, s)}:{point}:{it}" for p, s, point, it in traps]
    job = Job(tmp_path, pp, dp, STEPS, job_config(), optimizer, traps=points)
    job.launcher_args = ["--heartbeat-min-timeout", HANG_TIMEOUT]
    signals = [signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP if optimizer == "sgd" else signal.SIGKILL]
    start_with_faults(job, [([slot(dp, p, s)], sig) for (p, s, _, _), sig in zip(traps, signals, strict=True)])
    if optimizer == "sgd":
        assert job.count(r"published failure of slot 1: heartbeat stale") == 1, "the SIGSTOP is a hang"
    check(job, reference, len(traps))


def test_a_last_stage_worker_killed_at_its_loss_all_reduce(tmp_path, tmp_path_factory):
    """pp=2 x dp=2 with clipping: a last-stage worker killed after the data-parallel all-reduce, at
    the loss all-reduce that precedes the stage's optimizer step. Its replica waits there when the
    failure is announced: it has not stepped, so there is nothing to undo (an undo of the step it
    was about to take moved its parameters by a step; found by bench/fault_campaign.py)."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "sgd")
    victim = slot(dp, 1, 1)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "sgd", traps=[f"{victim}:loss:3"])
    start_with_faults(job, [([victim], signal.SIGKILL)])
    survivor = (tmp_path / "logs" / f"rank{slot(dp, 0, 1)}.log").read_text()
    assert re.search(r"slot \d+ stopped by a failure at iteration 3: .*the loss all-reduce", survivor), survivor[-3000:]
    check(job, reference, 1)


def test_d_minus_one_workers_of_a_stage_and_a_second_failure_during_recovery(tmp_path, tmp_path_factory):
    """pp=2 x dp=3: two of the three stage-1 workers killed in one iteration (during F and during B);
    then a stage-0 worker killed, and a second stage-0 worker hung (SIGSTOP) while the survivors
    rebuild. The recovery waits for the hang's heartbeat timeout (8 s), longer than the first one's
    respawn takes to start: the respawn must wait for the decision that removes its predecessor
    instead of taking its predecessor's epoch for its admission (found by bench/fault_campaign.py)."""
    pp, dp = 2, 3
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    first = [slot(dp, 0, 1), slot(dp, 2, 1)]
    then, during_recovery = slot(dp, 1, 0), slot(dp, 2, 0)
    traps = [f"{first[0]}:F:3", f"{first[1]}:B:3", f"{then}:W:12", f"{during_recovery}:recovery:12"]
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "adam", traps=traps)
    job.launcher_args = ["--heartbeat-min-timeout", "8"]
    job.start()
    try:
        run_faults(job, [(first, signal.SIGKILL)])
        joins = {s: job.count_events("accepted", kind="join", slot=s) for s in (then, during_recovery)}
        job.signal_when_trapped(then)
        job.signal_when_trapped(during_recovery, signal.SIGSTOP)
        iteration = max(job.progress(s) for s in range(pp * dp))
        hold_degraded(job, iteration)
        rejoin(job, [then, during_recovery], iteration, joins)
    except BaseException:
        job.kill()
        raise
    check(job, reference, 4)


def kill_stage_1_of_pp2xdp2(job: Job, iteration: int) -> Job:
    """Start ``job`` and SIGKILL both stage-1 workers in ``iteration`` (one during F, one during B)."""
    stage1 = [slot(job.dp, 0, 1), slot(job.dp, 1, 1)]
    job.traps = [f"{stage1[0]}:F:{iteration}", f"{stage1[1]}:B:{iteration}"]
    job.start()
    try:
        for s in stage1:
            job.signal_when_trapped(s)
    except BaseException:
        job.kill()
        raise
    return job


def test_a_stage_without_live_workers_stops_the_job_with_a_message(tmp_path):
    """Both stage-1 workers of pp=2 x dp=2 killed in one iteration: nothing to re-route to, and no
    checkpoint. The survivors say which stage and that there is no checkpoint, and the launcher
    stops the job (no respawn loop) with a non-zero exit code."""
    pp, dp = 2, 2
    job = kill_stage_1_of_pp2xdp2(Job(tmp_path, pp, dp, STEPS, job_config(), "adam", timeout=120), 3)
    assert job.finish() == 1, job.log_tail()
    assert job.count(r"stopped the job: training cannot go on in place") == 1
    assert job.count(r"job stopped before it finished: a stage lost every worker") == 1
    for s in (slot(dp, 0, 0), slot(dp, 1, 0)):
        log = (tmp_path / "logs" / f"rank{s}.log").read_text()
        assert f"rank {s} exited (code 76)" in "\n".join(job.lines)
        assert "stage 1 has no live worker left" in log and "No checkpoint is configured" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_a_lost_stage_restarts_every_rank_from_the_latest_checkpoint(tmp_path, tmp_path_factory):
    """With recycle.checkpoint (every 4 iterations), losing both stage-1 workers of pp=2 x dp=2
    during iteration 9 makes the survivors name the checkpoint and exit 75; ds-recycle launch
    --respawn restarts every rank, they resume from global_step8 (at most one interval lost), and
    the job ends with the fault-free parameters and optimizer state."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    config = job_config()
    config["recycle"]["checkpoint"] = {"dir": str(tmp_path / "checkpoints"), "interval": 4}
    job = kill_stage_1_of_pp2xdp2(Job(tmp_path, pp, dp, STEPS, config, "adam"), 9)
    assert job.finish() == 0, job.log_tail()
    assert job.count(r"restarting every rank from the checkpoint \(generation 1\)") == 1
    asked, restarted = job.events.select("restart_requested")[0], job.events.select("restarting")[0]
    assert restarted["time"] - asked["time"] < 20, "respawned joiners must not hold the restart for restart_grace"
    survivor = (tmp_path / "logs" / f"rank{slot(dp, 0, 0)}.log").read_text()
    assert "stage 1 has no live worker left" in survivor and "Last checkpoint: global_step8" in survivor
    assert survivor.count("resumed from checkpoint global_step8") == 1, survivor[-3000:]
    assert_final_states(job, reference, STEPS)


def test_a_failure_and_a_join_decided_in_one_recovery(tmp_path, tmp_path_factory):
    """pp=3 x dp=2: worker (1, 2) is killed during F of iteration 3 and the survivors wait at the
    next boundary until its respawn's join is accepted; then worker (0, 0) is killed. One recovery
    decision removes (0, 0) and admits (1, 2): the survivors roll back and re-sync the tied
    weights, and the joiner must take part in that re-sync (it left them waiting before). Then
    (0, 0) re-joins too."""
    pp, dp = 3, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "sgd")
    joiner, victim = slot(dp, 1, 2), slot(dp, 0, 0)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "sgd", traps=[f"{joiner}:F:3"])
    job.hold(4)
    kill_while_a_join_is_pending(job, joiner, victim, lambda: wait_until_held(job, [joiner]))
    check(job, reference, 2)
    survivor = (tmp_path / "logs" / f"rank{slot(dp, 1, 0)}.log").read_text()
    assert "failed [(0, 0)] joined [(1, 2)]" in survivor, survivor[-3000:]


def test_a_failure_mid_iteration_and_a_pending_join_decided_in_one_recovery(tmp_path, tmp_path_factory):
    """pp=3 x dp=2: worker (1, 2) is killed during F of iteration 3; its respawn waits at its gate
    until worker (0, 0) parks before the stage-0 all-reduce of iteration 5 (stages 1 and 2 step
    iteration 5 optimistically meanwhile), then asks to join; (0, 0) is killed. One recovery removes
    (0, 0), admits (1, 2), rolls back the optimistic steps and re-runs iteration 5 (seen by chance
    in a suite run, with every parameter off by up to 1e-2)."""
    pp, dp = 3, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "sgd")
    joiner, victim = slot(dp, 1, 2), slot(dp, 0, 0)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "sgd", traps=[f"{joiner}:F:3", f"{victim}:allreduce:5"])
    trapped = job.out / f"trapped{victim}"
    kill_while_a_join_is_pending(
        job, joiner, victim, lambda: job.wait_until(trapped.exists, f"slot {victim} to reach its trap")
    )
    check(job, reference, 2)
    survivor = (tmp_path / "logs" / f"rank{slot(dp, 1, 0)}.log").read_text()
    assert "failed [(0, 0)] joined [(1, 2)]" in survivor, survivor[-3000:]


def test_a_member_killed_after_every_member_entered_the_new_epoch(tmp_path, tmp_path_factory):
    """pp=2 x dp=2: worker (0, 1) is killed during F of iteration 3; worker (1, 0) parks once every
    survivor has counted itself into the recovery's epoch, before any of its groups exist, and is
    killed there. The other survivors must not wait for it in the world's construction (an eager
    gloo group waits for every member's address in a C++ store wait, for the group timeout: seen
    in CI); they stop in the first op that needs it, decide again without it, and go on. Worker
    (1, 1) needs it at once: the parked worker is the owner of the tied weight that (1, 1) re-syncs
    after the rollback, over a pair that both must connect. So (1, 1) reports both failures in one
    line (the first round's epoch was never entered). Both re-join."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    first, building = slot(dp, 0, 1), slot(dp, 1, 0)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "adam", traps=[f"{first}:F:3", f"{building}:building:3"])
    start_with_faults(job, [([first, building], signal.SIGKILL)])
    check(job, reference, 2)
    survivor = (tmp_path / "logs" / f"rank{slot(dp, 1, 1)}.log").read_text()
    assert "another failure during recovery" in survivor, survivor[-3000:]
    assert "epoch 2 from iteration 3: left [] failed [(0, 1), (1, 0)] joined []" in survivor, survivor[-3000:]


def test_a_member_killed_before_its_pair_groups_exist_stops_no_survivor(tmp_path, tmp_path_factory):
    """pp=3 x dp=2: worker (1, 2) is killed during F of iteration 3; worker (0, 0), rank 0 of the
    next world, parks on entering it (no group of it exists) and is killed there. The survivors
    that exchange messages with it connect their pair groups first with it: the group's lookup of
    its address holds the world's store client until the group timeout. A survivor that made its
    next pair group after that (every group publishes its address on that client) waited there in
    C++, beyond the failure flag (seen in a fault campaign: 40 s). Each survivor makes all its groups
    before it connects any, so every one stops at the flag and recovers within seconds. Fixed costs
    (no profile): the profile exchange, a collective over the world at an epoch's first iteration,
    would otherwise meet the dead member before any pair group."""
    pp, dp = 3, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    first, building = slot(dp, 1, 2), slot(dp, 0, 0)
    config = job_config()
    config["recycle"]["profile"] = False
    job = Job(tmp_path, pp, dp, STEPS, config, "adam", traps=[f"{first}:F:3", f"{building}:building:3"])
    start_with_faults(job, [([first, building], signal.SIGKILL)])
    recovered = check(job, reference, 2)
    assert recovered and max(recovered) < 10_000, recovered


def test_a_joiner_gives_up_when_a_member_dies_before_its_state_arrives(tmp_path, tmp_path_factory):
    """pp=2 x dp=2: worker (0, 1) is killed during F of iteration 3. Once its respawn is admitted,
    worker (1, 0) parks on entering the join's epoch (every member counted in, no group of it yet)
    and is killed there. Worker (1, 1), the joiner's state source, parks there too until the
    failure is announced (else the copy could end first). The joiner, waiting for its state, has no
    iteration to restart from: it gives up its join at once (exit 77; before, it waited in the connection for the group
    timeout, 120 s, and crashed) and its respawn asks again. The survivors recover without both, both
    re-join, and the job ends equal to a fault-free run. With fixed costs (no profile), the plan of
    each failure set was made ahead in the background (``recycle.prefetch_plans``): both changes
    find it in the cache."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    first, building, source = slot(dp, 0, 1), slot(dp, 1, 0), slot(dp, 1, 1)
    config = job_config()
    config["recycle"]["profile"] = False
    traps = [f"{first}:F:3", f"{building}:building:4", f"{source}:building:4:until-failure"]
    job = Job(tmp_path, pp, dp, STEPS, config, "adam", traps=traps)
    job.start()
    try:
        job.signal_when_trapped(first)
        hold_degraded(job, max(job.progress(s) for s in range(pp * dp)))
        job.wait_for_event("accepted", kind="join", slot=first)
        job.hold(None)  # the join is decided at the next boundary; (1, 0) parks entering its epoch
        job.signal_when_trapped(building)
        killed_at = time.time()
        gave_up = job.wait_for_event("exited", slot=first, code=JOIN_GIVEN_UP_EXIT_CODE, timeout=60)
        iteration = max(job.progress(s) for s in range(pp * dp))
        hold_degraded(job, iteration)
        job.wait_for_event("exited", slot=building, signal="SIGKILL")
        rejoin(job, [first, building], iteration, {first: 1, building: 0})
    except BaseException:
        job.kill()
        raise
    check(job, reference, 3)
    print(f"member killed to the joiner's exit: {gave_up['time'] - killed_at:.2f} s")
    joiner_log = (tmp_path / "logs" / f"rank{first}.log").read_text()
    assert re.search(r"slot \d gives up joining epoch \d+: a failure was announced", joiner_log), joiner_log[-3000:]
    assert job.count(rf"published failure of slot {first} \(code 77: it gave up its join\)") == 1, job.log_tail()
    changes = r"ReCycle epoch \d+ from iteration \d+: left \[\] failed \[\(.*\]"
    prefetched = job.count_in_rank_logs(changes + r"; plan \w+ \(prefetched\) predicts")
    assert prefetched == job.count_in_rank_logs(changes) >= 4, job.log_tail()  # 2 changes x 2 survivors


def test_a_failure_while_the_script_saves_a_checkpoint_is_recovered_and_the_checkpoint_written_whole(
    tmp_path, tmp_path_factory
):
    """pp=2 x dp=2, the script calling ``engine.save_checkpoint`` every 4 iterations between
    ``train_batch`` calls, as a DeepSpeed script does. Worker (0, 1) is SIGKILLed inside the save
    after iteration 8 (after DeepSpeed's first barrier, before it writes its files) while its peers
    wait in DeepSpeed's next barrier: the survivors recover inside the save, write global_step8
    again on the new plan (the live replica writes the dead worker's stage), and train on; the
    respawn re-joins and the job ends equal to a fault-free run."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    killed = slot(dp, 0, 1)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), "adam", traps=[f"{killed}:checkpoint:8"])
    job.worker_args = ["--save-every", "4"]
    start_with_faults(job, [([killed], signal.SIGKILL)])
    check(job, reference, 1)
    saving = r"stopped by a failure at iteration 8: (a failure was announced during )?the checkpoint in "
    assert job.count_in_rank_logs(saving) == pp * dp - 1, job.log_tail()
    saves = job.out / "saves"
    assert (saves / "latest").read_text() == f"global_step{STEPS}"
    written, whole = (
        sorted(path.name for path in (saves / tag).iterdir()) for tag in ("global_step8", f"global_step{STEPS}")
    )
    assert written == whole and [name for name in written if name.startswith("layer_")], (written, whole)


def test_a_failure_while_a_checkpoint_is_written_is_recovered_and_latest_stays_whole(tmp_path, tmp_path_factory):
    """pp=2 x dp=2 with recycle.checkpoint every 4 iterations. Worker (0, 1) is SIGKILLed and later
    worker (1, 0) SIGSTOPped inside DeepSpeed's save_checkpoint (after its first barrier, before the
    rank writes its files), while their peers wait in DeepSpeed's blocking barriers. Both are
    detected as any failure is (the hang at the 3 s heartbeat timeout, not at the group's 120 s):
    the survivors abandon that checkpoint, go on without the worker, and the respawn re-joins. The
    iteration every survivor had finished is kept: its ``train_batch`` returns, one iteration per call.
    ``latest`` only ever names a checkpoint whose files every stage wrote; the job ends equal to a
    fault-free run."""
    pp, dp = 2, 2
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, "adam")
    config = job_config()
    checkpoints = tmp_path / "checkpoints"
    config["recycle"]["checkpoint"] = {"dir": str(checkpoints), "interval": 4}
    killed, hung = slot(dp, 0, 1), slot(dp, 1, 0)
    job = Job(tmp_path, pp, dp, STEPS, config, "adam", traps=[f"{killed}:checkpoint:8", f"{hung}:checkpoint:16"])
    job.launcher_args = ["--heartbeat-min-timeout", HANG_TIMEOUT]
    job.start()
    try:
        run_faults(job, [([killed], signal.SIGKILL)])
        assert (checkpoints / "latest").read_text() != "global_step8", "a checkpoint cut short is not latest"
        run_faults(job, [([hung], signal.SIGSTOP)])
    except BaseException:
        job.kill()
        raise
    logs = "\n".join(path.read_text() for path in sorted((job.tmp / "logs").glob("*.log")))
    for iteration in (8, 16):
        assert re.search(rf"abandons the checkpoint at iteration {iteration}: ", logs), logs[-3000:]
    check(job, reference, 2)
    assert job.count(rf"published failure of slot {hung}: heartbeat stale") == 1, "the SIGSTOP is a hang"
    for record in job.records():  # every survivor had finished the iteration: each call ran one
        if record["incarnation"] == 0 and record["slot"] not in (killed, hung):
            assert sorted(record["losses"]) == list(range(STEPS)), f"slot {record['slot']}: {sorted(record['losses'])}"
    tag = (checkpoints / "latest").read_text()
    assert tag == f"global_step{STEPS}", tag
    written = sorted(path.name for path in (checkpoints / tag).iterdir())
    assert [name for name in written if name.startswith("layer_")], written
    assert "mp_rank_00_model_states.pt" in written, written
