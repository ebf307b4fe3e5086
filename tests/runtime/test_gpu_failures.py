"""ReCycle's failure path on CUDA with NCCL: a real ``ds-recycle launch --backend nccl`` job, a rank
SIGKILLed and another SIGSTOPped (a hang) mid-iteration from this test process, each respawned
and re-joined; every parameter and optimizer state ends equal to a fault-free run of the same job on
the same GPU(s), and every micro-batch counts once.

Four ranks share the GPUs present (one GPU: four NCCL ranks on it over loopback sockets,
``ds_recycle.runtime.rank.communication``). Skipped where torch sees no CUDA device (CI);
``scripts/gpu_check.sh`` runs it on a GPU.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

from ds_recycle.testing.jobs import Job, assert_same_as_fault_free, fault_free, hold_degraded, job_config, rejoin, slot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (none here); scripts/gpu_check.sh runs it on a GPU"
    ),
]

STEPS = 16
PP, DP = 2, 2


def test_a_killed_and_a_hung_rank_are_survived_and_rejoin_on_nccl(tmp_path, tmp_path_factory):
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam", backend="nccl")
    traps = [(0, 1, "B", 3, signal.SIGKILL), (1, 0, "F", 10, signal.SIGSTOP)]
    points = [f"{slot(DP, p, s)}:{point}:{it}" for p, s, point, it, _ in traps]
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam", traps=points, backend="nccl", timeout=300)
    job.launcher_args = ["--heartbeat-min-timeout", "3"]
    job.start()
    try:
        for p, s, _, _, sig in traps:
            victim = slot(DP, p, s)
            joins = job.count_events("accepted", kind="join", slot=victim)
            job.signal_when_trapped(victim, sig)
            iteration = max(job.progress(r) for r in range(PP * DP))
            hold_degraded(job, iteration)
            job.wait_for_event("exited", slot=victim, signal="SIGKILL", timeout=120)
            rejoin(job, [victim], iteration, {victim: joins})
    except BaseException:
        job.kill()
        raise
    code = job.finish()
    assert code == 0, job.log_tail()
    logs = "\n".join(path.read_text() for path in sorted((job.tmp / "logs").glob("*.log")))
    recovered = sorted({int(ms) for ms in re.findall(r"recovered (\d+) ms after the failure", logs)})
    aborts = [float(ms) for ms in re.findall(r"aborted its NCCL communicators in ([\d.]+) ms", logs)]
    print(f"nccl job: 2 failures; kill to recovered (ms, distinct over survivors): {recovered}; aborts (ms): {aborts}")
    assert "Watchdog caught collective operation timeout" not in logs, "torch's watchdog acted before ReCycle"
    assert aborts, "no survivor aborted its NCCL communicators"
    assert_same_as_fault_free(job, reference, STEPS)
