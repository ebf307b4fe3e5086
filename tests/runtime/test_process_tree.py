"""Signals as clusters send them, and ranks that die on their way in or out, in real
``ds-recycle launch`` jobs on gloo.

Slurm delivers a preemption notice or ``scancel`` to every process of a job step: each rank *and*
its helper processes (here two DataLoader workers and a forked process that the rank script starts,
with a map-style ``training_data``). The notice means "leave at the next boundary" for the rank;
it must not crash it. A leaver that dies before its boundary, and a joiner that dies while its join
is pending, are failures like any other (or, for the joiner, nothing at all to the survivors). Every
job ends with every parameter and optimizer state equal to a fault-free run and an exact F ledger.
"""

from __future__ import annotations

import signal

import pytest

from ds_recycle.testing.jobs import (
    Job,
    assert_same_as_fault_free,
    fault_free,
    hold_degraded,
    job_config,
    rejoin,
    slot,
    wait_until_held,
)

pytestmark = pytest.mark.multiprocess

PP, DP = 3, 2
STEPS = 30
DATA = "dataset"


def test_sigterm_to_every_process_of_a_rank_tree_means_leave(tmp_path, tmp_path_factory):
    """The first stage, a middle stage, then the last and the first stage at once: each rank's
    whole process group gets SIGTERM; each leaves at its boundary (exit 0), its respawn re-joins."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam", DATA)
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam", data=DATA, helpers=True).start()
    events = [[(1, 0)], [(0, 1)], [(1, 2), (0, 0)]]
    try:
        iteration = 2
        for workers in events:
            slots = [slot(DP, p, s) for p, s in workers]
            exits = {s: job.count_events("exited", slot=s, code=0) for s in slots}
            joins = {s: job.count_events("accepted", kind="join", slot=s) for s in slots}
            reached = job.signal_tree_at(slots, iteration, signal.SIGTERM)
            assert len(reached) > len(slots), f"the ranks' trees hold helpers: {reached}"
            hold_degraded(job, iteration)
            for s in slots:
                job.wait_for_event("exited", exits[s] + 1, slot=s, code=0)
            rejoin(job, slots, iteration, joins)
            iteration = max(job.progress(s) for s in range(PP * DP)) + 2
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.log_tail()
    assert job.count(r"published failure") == 0, "a leave is not a failure:\n" + job.log_tail()
    assert job.killed() == {}, "a leaver exits by itself and leaves its final record"
    assert_same_as_fault_free(job, reference, STEPS)


def test_a_leaver_killed_before_its_boundary_and_a_joiner_killed_while_pending(tmp_path, tmp_path_factory):
    """A middle-stage worker parked in F gets SIGTERM (its leave is accepted), then SIGKILL before
    its boundary: the survivors roll back and re-run the iteration without it, with no wait for the
    detect timeout. Its respawn asks to join while the survivors are held; it is SIGKILLed while
    that join is pending: the survivors do not notice (no recovery), and the next respawn re-joins.
    The respawn waits at its gate until the survivors are held (a preloaded respawn asks within a
    second, and its join could otherwise be decided at a boundary before the test's SIGKILL)."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam", DATA)
    leaver = slot(DP, 0, 1)
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam", data=DATA, traps=[f"{leaver}:F:3"])
    job.worker_args = ["--gate"]
    gate = job.out / f"gate{leaver}"
    job.start()
    try:
        job.wait_until(lambda: (job.out / f"trapped{leaver}").exists(), f"slot {leaver} to reach its trap")
        job.signal_tree_at([leaver], 0, signal.SIGTERM)
        job.wait_for_event("accepted", kind="leave", slot=leaver)
        gate.touch()
        job.signal_tree_at([leaver], 0, signal.SIGKILL)
        job.wait_for_event("published_failure", slot=leaver, why="signal SIGKILL while leaving")
        iteration = max(job.progress(s) for s in range(PP * DP))
        hold_degraded(job, iteration)
        wait_until_held(job, [leaver])
        gate.unlink()
        job.wait_for_event("accepted", kind="join", slot=leaver)
        recoveries = job.count_in_rank_logs(r"recovery decision")
        job.signal_tree_at([leaver], 0, signal.SIGKILL)  # the respawn: it started before it asked
        job.wait_for_event("published_failure", slot=leaver, why="signal SIGKILL while its join was pending")
        rejoin(job, [leaver], iteration, {leaver: 1})
        assert job.count_in_rank_logs(r"recovery decision") == recoveries, (
            "a pending joiner's death cost the survivors nothing"
        )
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.log_tail()
    assert job.count("MembershipError") == 0
    assert_same_as_fault_free(job, reference, STEPS)
