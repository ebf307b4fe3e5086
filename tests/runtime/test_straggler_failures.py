"""A straggler in a real ``ds-recycle launch`` job on gloo, through a failure and a re-join.

pp=2 x dp=2, every op padded to 8 ms and worker (1, 1)'s to 2.5x that. The straggler is planned
around after the profile's warm-up and a full window; then its stage peer (0, 1) is SIGKILLed
mid-iteration (the straggler must now run everything of its stage), respawned and re-joined: the
joiner starts with a fresh cost tracker and must take over the others' (the straggler is handed work
away again), or the ranks would plan differently and hang. The job ends with every parameter,
optimizer state and loss equal to the fault-free run's and every micro-batch once per stage and
iteration.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from ds_recycle.testing.jobs import (
    CLIP,
    EMULATION,
    Job,
    M,
    assert_same_as_fault_free,
    fault_free,
    final_states,
    hold_degraded,
    rejoin,
    slot,
)
from ds_recycle.testing.tiny import ds_config

pytestmark = pytest.mark.multiprocess

STEPS = 24
PP, DP = 2, 2
STRAGGLER = (1, 1)
FAIL_AT = 9
"""The peer's failure: after the straggler is planned around (a full window of 4 iterations after
the warm-up of 2, then 2 agreements in a row: from iteration 7 on)."""


def test_a_straggler_stays_planned_around_through_a_failure_and_a_rejoin(tmp_path, tmp_path_factory):
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    timing = {**EMULATION["emulate_timing"], "slowdown": [[*STRAGGLER, 2.5]]}
    config = ds_config(M, CLIP, {"enabled": True, "emulate_timing": timing})
    peer = slot(DP, 0, 1)
    job = Job(tmp_path, PP, DP, STEPS, config, "adam", traps=[f"{peer}:B:{FAIL_AT}"])
    job.start()
    try:
        joins = {peer: job.count_events("accepted", kind="join", slot=peer)}
        job.signal_when_trapped(peer, signal.SIGKILL)
        iteration = max(job.progress(s) for s in range(PP * DP))
        hold_degraded(job, iteration)
        job.wait_for_event("exited", slot=peer, signal="SIGKILL")
        rejoin(job, [peer], iteration, joins)
    except BaseException:
        job.kill()
        raise
    assert job.finish() == 0, job.log_tail()
    assert job.count_in_rank_logs(r"worker \(1, 1\) planned as a straggler") >= 1, job.log_tail()
    assert_same_as_fault_free(job, reference, STEPS)
    # the straggler handed micro-batches to its peer before the failure and again after the re-join
    straggler = final_states(job.records())[slot(DP, *STRAGGLER)]
    own = Counter(entry[0] for entry in straggler["ledger"])
    handed = [i for i in range(STEPS) if own[i] < M]
    assert any(i < FAIL_AT for i in handed) and any(i > iteration + 2 for i in handed), (handed, iteration)
