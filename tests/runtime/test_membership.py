"""Leave and re-join at iteration boundaries, in real ``ds-recycle launch`` jobs on gloo.

Workers are sent a real SIGTERM from this test process (a preemption notice: finish the iteration,
then leave); the launcher respawns them and they re-join from a live replica. Each job ends with
every parameter and every optimizer state equal to a fault-free run of the same job, the same loss
at every iteration, and a ledger in which every micro-batch of every iteration ran F exactly once
per stage.
"""

from __future__ import annotations

import pytest

from ds_recycle.testing.jobs import Job, assert_same_as_fault_free, fault_free, hold_degraded, job_config, rejoin, slot

pytestmark = pytest.mark.multiprocess

STEPS = 24


@pytest.mark.parametrize(
    "pp,dp,optimizer,events",
    [
        # first stage, then D-1 workers of the last stage
        (2, 3, "adam", [[(1, 0)], [(0, 1), (2, 1)]]),
        # a middle stage, then the first and the last stage at once
        (3, 2, "sgd", [[(1, 1)], [(0, 0), (1, 2)]]),
        # the last stage, then two stages of one pipeline
        (4, 2, "adam", [[(1, 3)], [(0, 1), (0, 2)]]),
    ],
    ids=["pp2xdp3", "pp3xdp2", "pp4xdp2"],
)
def test_leave_and_rejoin_keeps_fault_free_math(tmp_path, tmp_path_factory, pp, dp, optimizer, events):
    reference = fault_free(tmp_path_factory, pp, dp, STEPS, optimizer)
    job = Job(tmp_path, pp, dp, STEPS, job_config(), optimizer).start()
    try:
        iteration = 2
        for workers in events:
            slots = [slot(dp, p, s) for p, s in workers]
            exits = {s: job.count_events("exited", slot=s, code=0) for s in slots}
            joins = {s: job.count_events("accepted", kind="join", slot=s) for s in slots}
            job.signal_at(slots, iteration)  # SIGTERM: leave at the next boundary
            hold_degraded(job, iteration)
            for s in slots:
                job.wait_for_event("exited", exits[s] + 1, slot=s, code=0)
            rejoin(job, slots, iteration, joins)
            iteration = max(job.progress(s) for s in range(pp * dp)) + 2
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.log_tail()
    assert job.count("respawned") >= sum(len(e) for e in events)
    assert job.killed() == {}, "a leaver exits by itself and leaves its final record"
    assert_same_as_fault_free(job, reference, STEPS)
