"""Leave and re-join at iteration boundaries, in real ``ds-recycle launch`` jobs on gloo.

Workers are sent a real SIGTERM from this test process (a preemption notice: finish the iteration,
then leave); the launcher respawns them and they re-join from a live replica. Each job ends with
every parameter and every optimizer state equal to a fault-free run of the same job, the same loss
at every iteration, and a ledger in which every micro-batch of every iteration ran F exactly once
per stage.
"""

from __future__ import annotations

import pytest
import torch
from recycle_job import Job, assert_ledger_exact, ds_config, final_states

pytestmark = pytest.mark.multiprocess

M = 4
CLIP = 0.5
EMULATION = {"emulate_timing": {"F": 8, "B": 8, "W": 8}}
RTOL, ATOL = 1e-6, 1e-7
DEGRADED_ITERATIONS = 4


def slot(pp_dp: tuple[int, int], pipeline: int, stage: int) -> int:
    return stage * pp_dp[1] + pipeline


def run_fault_free(tmp_path, pp: int, dp: int, steps: int, optimizer: str) -> dict[int, dict]:
    job = Job(tmp_path / "fault_free", pp, dp, steps, ds_config(M, CLIP, EMULATION), optimizer, respawn=False)
    code = job.start().finish()
    assert code == 0, job.log_tail()
    return final_states(job.records())


def leave_and_rejoin(job: Job, slots: list[int], iteration: int) -> None:
    """SIGTERM ``slots`` once the first has run ``iteration`` iterations, let the others run a few
    iterations without them, then hold the job at a boundary until their respawns are accepted."""
    exits = {s: job.count(rf"rank {s} exited \(code 0\)") for s in slots}
    joins = {s: job.count(rf"accepted join of slot {s} ") for s in slots}
    job.signal_at(slots, iteration)
    job.hold(iteration + DEGRADED_ITERATIONS)
    for s in slots:
        job.wait_for_line(rf"rank {s} exited \(code 0\)", exits[s] + 1)
    for s in slots:
        job.wait_for_line(rf"accepted join of slot {s} ", joins[s] + 1, timeout=180)
    job.hold(None)
    for s in slots:
        job.wait_until(lambda s=s: job.progress(s) > iteration + 1, f"slot {s} to train again after re-joining")


def assert_same_as(fault_free: dict[int, dict], records: list[dict], pp: int, dp: int, steps: int) -> None:
    finished = final_states(records)
    assert sorted(finished) == sorted(fault_free), f"finished slots {sorted(finished)}"
    reference_losses = next(iter(fault_free.values()))["losses"]
    worst = max(
        (record["params"][name] - value).abs().max().item()
        for s, record in finished.items()
        for name, value in fault_free[s]["params"].items()
    )
    print(f"max |parameter - fault-free parameter| over {len(finished)} workers: {worst:.3g}")
    for s, record in finished.items():
        want = fault_free[s]
        assert record["global_steps"] == steps
        for name, value in want["params"].items():
            torch.testing.assert_close(record["params"][name], value, rtol=RTOL, atol=ATOL, msg=f"slot {s} {name}")
        for index, state in want["optimizer"]["state"].items():
            for key, value in state.items():
                got = record["optimizer"]["state"][index][key]
                torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL, msg=f"slot {s} optimizer {index}.{key}")
    for record in records:
        for iteration, loss in record["losses"].items():
            assert loss == pytest.approx(reference_losses[iteration], rel=RTOL), f"slot {record['slot']} it {iteration}"
    assert_ledger_exact(records, pp, dp, M, steps)


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
def test_leave_and_rejoin_keeps_fault_free_math(tmp_path, pp, dp, optimizer, events):
    steps = 24
    fault_free = run_fault_free(tmp_path, pp, dp, steps, optimizer)
    job = Job(tmp_path / "failures", pp, dp, steps, ds_config(M, CLIP, EMULATION), optimizer).start()
    try:
        iteration = 2
        for workers in events:
            slots = [slot((pp, dp), p, s) for p, s in workers]
            leave_and_rejoin(job, slots, iteration)
            iteration = max(job.progress(s) for s in range(pp * dp)) + 2
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.log_tail()
    text = "\n".join(job.lines)
    assert text.count("respawned") >= sum(len(e) for e in events)
    assert_same_as(fault_free, job.records(), pp, dp, steps)
