"""Memory caps from measured bytes in real ``ds-recycle launch`` jobs on gloo (tiny GPT, pp=3 x dp=2).

Each rank measures what its first micro-batch holds and its static bytes; the ranks agree on one
table at the start of iteration 1 and derive every stage's cap under ``recycle.memory_limit_gb``.
With ``DS_RECYCLE_MEMORY_AUDIT=1`` every rank follows every micro-batch and logs, per iteration,
the most micro-batches it held in flight (from its executed instruction events) and the most bytes
they held together; the tests read those lines.

The limits are set from the tiny GPT's measured bytes (the engine logs them: stage 1 holds
406,624 static bytes and 157,200 per micro-batch, stages 0 and 2 far less), so that stage 1 fits
2.5 micro-batches (cap 2, below the 3 of the fault-free schedule) or half of one (cap 0).
"""

from __future__ import annotations

import re

import pytest

from ds_recycle.engine.memory_cap import AUDIT_ENV, GIB, peak_in_flight
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.testing.jobs import (
    Job,
    M,
    assert_every_microbatch_once,
    assert_final_states,
    fault_free,
    job_config,
    slot,
)

pytestmark = pytest.mark.multiprocess

PP, DP, STEPS = 3, 2, 24
"""The job of tests/runtime/test_failures.py, so that a whole-suite run shares its fault-free run."""
STAGE1_STATIC, STAGE1_PER_MICROBATCH = 406_624, 157_200
AUDIT = re.compile(
    r"memory audit: worker \((\d+), (\d+)\) iteration (\d+) epoch (\d+): in flight at most (\d+) "
    r"\(plan cap (\d+), planner cap (\w+), stage cap (\w+)\); held at most (\d+) bytes \+ static (\w+) of limit (\w+)"
)


def limit_gb(micro_batches: float) -> float:
    """A limit that fits ``micro_batches`` of stage 1's beside its static bytes."""
    return (STAGE1_STATIC + micro_batches * STAGE1_PER_MICROBATCH) / GIB


def capped_job(tmp_path, micro_batches: float, victim: int, iteration: int) -> Job:
    config = job_config()
    config["recycle"]["memory_limit_gb"] = limit_gb(micro_batches)
    job = Job(tmp_path, PP, DP, STEPS, config, "adam", respawn=False, traps=[f"{victim}:F:{iteration}"])
    job.env = {AUDIT_ENV: "1"}
    job.start()
    try:
        job.signal_when_trapped(victim)
    except BaseException:
        job.kill()
        raise
    return job


def rank_logs(job: Job) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted((job.tmp / "logs").glob("*.log")))


def test_a_failure_is_planned_under_the_memory_cap_and_ends_at_the_fault_free_parameters(tmp_path, tmp_path_factory):
    """Worker (1, 1) SIGKILLed in F of iteration 3; its micro-batches go to (0, 1), whose default
    plan would hold 3 in flight. Under the cap of 2 no worker holds more than 2 (executed
    instructions), the bytes held stay under the limit, and the survivors end with the parameters,
    optimizer state and losses of the fault-free run."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    victim = slot(DP, 1, 1)
    uncapped = peak_in_flight(plan_heuristic(DP, PP, M, [(1, 1)]))
    assert uncapped[(0, 1)] == 3, "the cap must matter: the default plan holds 3 on the re-routed worker"
    job = capped_job(tmp_path, 2.5, victim, 3)
    assert job.finish() == 0, job.log_tail()
    logs = rank_logs(job)
    assert logs.count("ReCycle: the fault-free schedule does not fit in memory") == 1, logs[-3000:]
    assert "every plan runs under a cap of 2 micro-batches" in logs
    audits = [tuple(match.groups()) for match in AUDIT.finditer(logs)]
    degraded = set()
    for p, s, iteration, epoch, peak, plan_cap, planner_cap, stage_cap, held, static, limit in audits:
        if int(iteration) == 0:
            continue  # measured on the default plan, before the agreement
        assert planner_cap == "2" and int(plan_cap) == 2 and int(peak) <= 2, (p, s, iteration, peak, plan_cap)
        assert int(peak) <= int(stage_cap)
        assert int(held) + int(static) <= int(limit), (p, s, iteration, held, static, limit)
        if int(epoch) > 0:
            degraded.add((int(p), int(s)))
    assert (0, 1) in degraded and (1, 1) not in degraded, sorted(degraded)

    survivors = {s: record for s, record in reference.items() if s != victim}
    assert_every_microbatch_once(job, assert_final_states(job, survivors, STEPS), STEPS)


def test_a_failure_set_whose_plan_cannot_fit_takes_the_fallback_in_one_line(tmp_path):
    """A limit that leaves stage 1 room for half a micro-batch: said once at the start; when
    worker (1, 1) dies, every survivor says in one line that the failure set's plan cannot fit
    (the failure set, the cap, the bytes) and the job stops as a job that lost a stage does without
    a checkpoint (exit 76 per rank, launcher exit 1), without a traceback."""
    victim = slot(DP, 1, 1)
    job = capped_job(tmp_path, 0.5, victim, 2)
    assert job.finish() == 1, job.log_tail()
    logs = rank_logs(job)
    assert logs.count("ReCycle: the fault-free schedule does not fit in memory: not even one micro-batch fits") == 1
    lines = [line for line in logs.splitlines() if "cannot fit in memory" in line]
    assert len(lines) == PP * DP - 1, lines
    for line in lines:
        assert "the plan for failure set [(1, 1)] cannot fit in memory: memory cap 0 micro-batches" in line, line
        assert f"stage 1 needs {STAGE1_STATIC} static + 1 x {STAGE1_PER_MICROBATCH} bytes" in line, line
        assert "No checkpoint is configured (recycle.checkpoint), so the job stops here" in line, line
    assert job.count(r"job stopped before it finished") == 1, job.log_tail()
    assert "Traceback" not in logs, logs[-3000:]
