"""The README's Slurm batch script run by a real Slurm (issue 43): Debian's Slurm 22.05 on this
machine, three slurmd "nodes" of 2 CPUs in network namespaces (ds_recycle.testing.slurm_cluster),
one cluster for the module. The job is the multi-node tests' (pp=2 x dp=3, 2 ranks per node) and
ends equal to a ``ds-recycle launch`` fault-free run of it.

The script is the README's, CPU variant. Its diff against the README's::

    -#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --no-kill --requeue --open-mode=append
    +#SBATCH --nodes=3 --ntasks-per-node=1 --no-kill --requeue --open-mode=append
    -    --respawn train.py --deepspeed_config ds_config.json
    +    --nproc-per-node 2 --preload --respawn WORKER ARGS

(no GPUs: 2 ranks per node given by hand instead of SLURM_GPUS_ON_NODE, and forked from one
preloaded agent, which NCCL refuses; the job's script and config are the tests' worker.)

What Slurm does, as these tests found it (the cases of the issue):

1. Fault-free: the job ends COMPLETED (ExitCode 0:0 in ``scontrol show job`` and in the
   jobcomp/filetxt log). ``sacct`` cannot say it here: slurmdbd needs MySQL, so accounting is off
   (``sacct`` answers "Slurm accounting storage is disabled").
2. Slurm has no per-node step signal: ``scancel --signal=TERM J.S`` goes to every node of the step
   (to every process of each node's task, with proctrack/linuxproc). One node's share of it is
   sent here by hand (what a node's own shutdown does). That node's ranks leave at a boundary, its
   agent exits 143 (srun: "task 2: Exited with exit code 143") and the step goes on; ``srun
   --overlap --jobid J -w NODE`` into the allocation re-admits it. srun's exit status is the
   largest of its tasks', so the job ends FAILED 143 though training finished.
3. A node lost (its slurmd, step daemon, agent and ranks SIGKILLed): srun notices nothing until
   slurmctld sets the node DOWN (SlurmdTimeout, 6 s here: about 15 s; default 300 s). With
   ``--no-kill`` on sbatch and srun the node is then removed from the job and the step goes on
   (without it the whole job is killed and requeued). ds_recycle fails the node after its lease
   (5 s) and trains on without it meanwhile.
4. ``scontrol update nodename=N state=down``: at once, the node is removed from the job and its
   task SIGKILLed (no SIGTERM first): for ds_recycle a node's loss. The node no longer belongs to
   the allocation (``srun --overlap -w N`` is refused); it is re-admitted by an allocation of its
   own (``srun -N1 -w N ds-recycle launch --nnodes 3 --node-rank K ...``).
5. ``scontrol requeue J``: SIGTERM to every task, SIGKILL after KillWait; the job is PENDING with
   BeginTime now+120 s (``scontrol update jobid=J StartTime=now`` lets it start), then runs the
   script again, and every rank resumes from the latest ``recycle.checkpoint``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ds_recycle.testing import slurm_cluster
from ds_recycle.testing.jobs import (
    WORKER,
    Job,
    assert_final_states,
    assert_same_as_fault_free,
    fault_free,
    job_config,
)
from ds_recycle.testing.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1500)]

PP, DP = 2, 3
NODES, PER_NODE = 3, 2
STEPS = 24
"""The job of tests/runtime/test_multinode.py: its fault-free reference is run once per session."""
INTERVAL = 4
JOB_TIMEOUT = 600.0
"""Bound on a job's start and end: 6 ranks importing torch and DeepSpeed on 2 shared cores."""
WAIT = 180.0
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
"""Under CI=true a missing Slurm fails where scripts/bootstrap.sh would have installed it (root
with apt-get) and skips elsewhere."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.unavailable()
    if reason:
        could_install = os.geteuid() == 0 and subprocess.run(["which", "apt-get"], capture_output=True).returncode == 0
        if IN_CI and could_install:
            pytest.fail(f"{reason} under CI=true: scripts/bootstrap.sh installs slurm-wlm and munge as root")
        pytest.skip(reason)
    started = SlurmCluster(tmp_path_factory.mktemp("slurm"), NODES).start(guard=True)
    yield started
    started.stop()


def script(job: Job) -> Path:
    """The README's batch script, CPU variant (the module docstring shows the diff)."""
    path = job.tmp / "job.sbatch"
    args = f"--pp {PP} --steps {job.steps} --optimizer adam --config {job.tmp}/ds_config.json --out {job.out}"
    path.write_text(
        f"""#!/bin/bash
#SBATCH --nodes={NODES} --ntasks-per-node=1 --no-kill --requeue --open-mode=append
(umask 077; openssl rand -hex 16 > "token.$SLURM_JOB_ID")   # the job's secret, for a later srun too
srun --no-kill --kill-on-bad-exit=0 ds-recycle launch --token-file "token.$SLURM_JOB_ID" \\
    --rdzv-endpoint "$(scontrol show hostnames | head -1):29500" \\
    --nproc-per-node {PER_NODE} --preload --respawn {WORKER} {args}
"""
    )
    return path


def job_env() -> dict[str, str]:
    """The job's environment (sbatch exports the submitter's): ds-recycle on PATH, the CPU. The
    venv's bin goes last: its ninja is not the one the suite's other ranks find first, and torch
    rebuilds DeepSpeed's shm op whenever the ninja that checks it changes (a rank killed during such
    a build leaves its lock behind for every later rank)."""
    return {"PATH": f"{os.environ['PATH']}:{Path(sys.executable).parent}", "DS_ACCELERATOR": "cpu"}


def submit(cluster: SlurmCluster, job: Job) -> int:
    return cluster.sbatch(
        script(job), f"--chdir={job.tmp}", f"--output={job.tmp}/slurm-%j.out", env=job_env(), cwd=job.tmp
    )


def readmit(cluster: SlurmCluster, job: Job, job_id: int | None, node: int, log: str) -> subprocess.Popen:
    """Start node ``node``'s agent again: a step into the allocation (``srun --overlap --jobid``), or
    with ``job_id`` None an allocation of its own. Such a step is one node: Slurm sets
    SLURM_NNODES=1, SLURM_NODEID=0 and SLURM_JOB_NODELIST to that node there, so the node rank, the
    number of nodes and the endpoint are given."""
    token = next(job.tmp.glob("token.*"))
    where = ["--overlap", f"--jobid={job_id}"] if job_id else []
    command = ["srun", *where, f"--chdir={job.tmp}", "-N1", "-n1", "-w", cluster.node_name(node), "--no-kill"]
    command += ["ds-recycle", "launch", "--nnodes", str(NODES), "--node-rank", str(node)]
    command += ["--rdzv-endpoint", f"{cluster.node_name(0)}:29500", "--token-file", str(token)]
    command += ["--nproc-per-node", str(PER_NODE), "--preload", "--respawn", str(WORKER), "--pp", str(PP)]
    command += ["--steps", str(job.steps), "--optimizer", "adam", "--config", str(job.tmp / "ds_config.json")]
    command += ["--out", str(job.out)]
    return cluster.popen(command, job.tmp / log, env=job_env())


def output(job: Job) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(job.tmp.glob("*.out")))


def count(job: Job, pattern: str) -> int:
    return len(re.findall(pattern, output(job), re.M))


def wait_until(cluster: SlurmCluster, job: Job, condition: Callable[[], bool], what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{output(job)[-6000:]}\n" + "\n".join(
        cluster.log_tail(name, 1500) for name in ("slurmctld", "slurmd.n0")))  # fmt: skip


def at_least(job: Job, iteration: int, slots: list[int] | None = None) -> Callable[[], bool]:
    return lambda: min(job.progress(s) for s in (range(PP * DP) if slots is None else slots)) >= iteration


def ended(cluster: SlurmCluster, job_id: int) -> Callable[[], bool]:
    return lambda: cluster.job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL")


def test_the_batch_script_runs_the_job_to_the_end_equal_to_a_launch_run(cluster, tmp_path, tmp_path_factory):
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    started = time.monotonic()
    job_id = submit(cluster, job)
    wait_until(cluster, job, ended(cluster, job_id), "the job's end", JOB_TIMEOUT)
    print(f"sbatch to the job's end: {time.monotonic() - started:.1f} s")
    fields = cluster.job(job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(job)[-4000:]
    assert cluster.completed(job_id)["JobState"] == "COMPLETED"
    assert "accounting storage is disabled" in cluster.run(["sacct", "-j", str(job_id)], check=False).stderr
    assert count(job, r"job finished: every member exited 0") == NODES
    assert_same_as_fault_free(job, reference, STEPS)


def test_a_preempted_node_leaves_and_a_downed_node_fails_both_readmitted(cluster, tmp_path, tmp_path_factory):
    """Node 2's task and its ranks get SIGTERM (its share of ``scancel --signal=TERM``): its two
    ranks leave at a boundary, the job goes on, and a step into the allocation brings them back.
    Then node 1 is set DOWN: Slurm SIGKILLs its task and drops it from the job; ds_recycle fails
    its two slots in one change, and a one-node allocation on it re-admits them."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    job.hold(4)
    job_id = submit(cluster, job)
    extra: list[subprocess.Popen] = []
    try:
        wait_until(cluster, job, at_least(job, 4), "every rank at iteration 4", JOB_TIMEOUT)
        job.hold(8)
        termed = time.time()
        for pid in cluster.task_pids(2):
            os.kill(pid, signal.SIGTERM)
        for s in (4, 5):
            wait_until(cluster, job, lambda s=s: count(job, rf"slot {s} \(worker \S+ \S+\) left the job") == 1, "leave")
        left = time.time()
        wait_until(cluster, job, lambda: count(job, r"srun: error: n2: task 2: Exited with exit code 143") == 1, "exit")
        assert cluster.job(job_id)["JobState"] == "RUNNING"
        print(f"SIGTERM to node 2's task to both its ranks out: {left - termed:.2f} s")

        joins = {s: count(job, rf"accepted join of slot {s} ") for s in range(PP * DP)}
        extra.append(readmit(cluster, job, job_id, 2, "readmit_n2.out"))
        for s in (4, 5):
            wait_until(cluster, job, lambda s=s: count(job, rf"accepted join of slot {s} ") > joins[s], f"{s}'s join")
        job.hold(12)
        wait_until(cluster, job, at_least(job, 12), "every rank at iteration 12 after node 2's re-admission")

        job.hold(16)
        downed = time.time()
        cluster.run(["scontrol", "update", "nodename=n1", "state=down", "reason=issue43"])
        node_failed = r"published failure of node 1: slots \[2, 3\] in one change"
        wait_until(cluster, job, lambda: count(job, node_failed) == 1, "node 1's failure")
        print(f"state=down to node 1's failure published: {time.time() - downed:.2f} s")
        wait_until(cluster, job, lambda: count(job, r"srun: error: n1: task 1: Killed") == 1, "srun's report")
        assert cluster.job(job_id)["NodeList"] == "n[0,2]"
        refused = cluster.run(["srun", "--overlap", f"--jobid={job_id}", "-N1", "-w", "n1", "true"], check=False)
        assert refused.returncode != 0, refused
        wait_until(cluster, job, at_least(job, 13, [0, 1, 4, 5]), "the survivors on the new plan")
        cluster.wait_idle([1])  # ReturnToService=2: a DOWN node that answers is back; else state=resume
        joins = {s: count(job, rf"accepted join of slot {s} ") for s in range(PP * DP)}
        extra.append(readmit(cluster, job, None, 1, "readmit_n1.out"))
        for s in (2, 3):
            wait_until(cluster, job, lambda s=s: count(job, rf"accepted join of slot {s} ") > joins[s], f"{s}'s join")
        job.hold(None)
        wait_until(cluster, job, ended(cluster, job_id), "the job's end", JOB_TIMEOUT)
        for process in extra:
            process.wait(timeout=60)
    finally:
        for process in extra:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    fields = cluster.job(job_id)
    print(
        f"job {job_id}: {fields['JobState']} {fields['ExitCode']}; re-admissions exit {[p.returncode for p in extra]}"
    )
    assert fields["JobState"] == "FAILED", "srun ends with the largest status of its tasks: node 2's first agent's 143"
    assert [p.returncode for p in extra] == [0, 0]
    assert_same_as_fault_free(job, reference, STEPS)


def test_a_lost_node_then_the_whole_step_preempted_then_requeued_resumes_from_the_checkpoint(
    cluster, tmp_path, tmp_path_factory
):
    """Node 2 is lost as a whole (slurmd, slurmstepd, agent and ranks SIGKILLed): ds_recycle fails
    it after its lease and trains on; Slurm sets it DOWN after SlurmdTimeout and drops it from the
    job (``--no-kill``), the step goes on. Then ``scancel --signal=TERM`` to the whole step: every
    rank leaves, the step ends. The job is requeued: every rank resumes from the checkpoint."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    config = job_config()
    config["recycle"]["checkpoint"] = {"dir": str(tmp_path / "checkpoints"), "interval": INTERVAL}
    job = Job(tmp_path, PP, DP, STEPS, config, "adam")
    job.hold(6)
    job_id = submit(cluster, job)
    wait_until(cluster, job, at_least(job, 6), "every rank at iteration 6", JOB_TIMEOUT)
    job.hold(10)
    killed_at = time.time()
    cluster.kill_node(2)
    wait_until(cluster, job, lambda: count(job, r"published failure of node 2: slots \[4, 5\] in one change") == 1, "")
    print(f"node 2 SIGKILLed to its failure published: {time.time() - killed_at:.2f} s")
    wait_until(cluster, job, at_least(job, 10, [0, 1, 2, 3]), "the survivors at iteration 10")
    wait_until(cluster, job, lambda: cluster.node_states().get("n2") == "DOWN*", "Slurm to set n2 DOWN", 120)
    print(f"node 2 SIGKILLed to Slurm's DOWN: {time.time() - killed_at:.2f} s")
    fields = cluster.job(job_id)
    assert (fields["JobState"], fields["NodeList"]) == ("RUNNING", "n[0-1]")
    wait_until(cluster, job, lambda: count(job, r"srun: error: Node failure on n2") == 1, "srun's report")

    job.hold(12)
    cluster.run(["scancel", "--signal=TERM", f"{job_id}.0"])
    wait_until(cluster, job, ended(cluster, job_id), "the job's end after the step's SIGTERM", 120)
    fields = cluster.job(job_id)
    print(f"after the whole step's SIGTERM: {fields['JobState']} {fields['ExitCode']}")
    assert count(job, r"left the job at iteration") >= 1

    latest = (tmp_path / "checkpoints" / "latest").read_text()
    cluster.start_slurmd(2)
    cluster.wait_idle()
    for path in job.out.glob("progress*"):
        path.unlink()
    job.hold(None)
    cluster.run(["scontrol", "requeue", str(job_id)])
    cluster.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])  # else BeginTime is now+120 s
    wait_until(cluster, job, lambda: cluster.job(job_id).get("Restarts") == "1", "the requeue")
    wait_until(cluster, job, ended(cluster, job_id), "the requeued job's end", JOB_TIMEOUT)
    fields = cluster.job(job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output(job)[-4000:]
    assert count(job, rf"resumed from checkpoint {latest}") == PP * DP, output(job)[-4000:]
    assert_final_states(job, reference, STEPS)
