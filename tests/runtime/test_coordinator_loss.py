"""The coordinator's host dies (issue 16, item 6): 2 agents x 2 ranks (pp=2 x dp=2) on loopback,
with the coordinator hosted by node 0's agent or by a standalone ``ds-recycle coordinator``.

The host is SIGKILLed from outside in the middle of training, after a ``recycle.checkpoint`` was
written: every other agent fences its ranks within its coordinator timeout and waits. The host is
started again; it runs the next generation, every rank resumes from the latest checkpoint, and the
job ends with every parameter and optimizer state equal to a fault-free run. Without a checkpoint
the restarted job stops with a message; with no coordinator back, the agents give up after their
bounded wait. Only processes started here are killed, by process group.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ds_recycle.testing.agents import Agent, Coordinator, count, free_port, wait_until, zombie_or_gone
from ds_recycle.testing.jobs import Job, assert_final_states, fault_free, job_config

pytestmark = pytest.mark.multiprocess

PP, DP = 2, 2
NODES = 2
STEPS = 16
INTERVAL = 4
UNSAFE = ("--allow-unsafe-placement",)
"""Stage-major pp=2 x dp=2 on 2 nodes of 2: node 0 holds every stage-0 worker. A node's loss is not
what these tests are about; the coordinator's is (its loss restarts every rank anyway)."""


def checkpointed(tmp_path: Path) -> dict:
    config = job_config()  # gradient_clipping 0.5
    config["recycle"]["checkpoint"] = {"dir": str(tmp_path / "checkpoints"), "interval": INTERVAL}
    return config


def start(job: Job, port: int, standalone: bool, wait: str = "120") -> tuple[list[Agent], list[Coordinator]]:
    extra = (*UNSAFE, "--coordinator-wait", wait, *(("--external-coordinator",) if standalone else ()))
    coordinators = [Coordinator(job, port, NODES, 2, tag="0")] if standalone else []
    agents = [Agent(job, node, port, NODES, extra=extra) for node in range(NODES)]
    return agents, coordinators


def kill_host(agents: list[Agent], coordinators: list[Coordinator]) -> float:
    """SIGKILL the coordinator's host: the standalone coordinator, or node 0's whole process group."""
    killed_at = time.time()
    if coordinators:
        coordinators[-1].kill()
    else:
        agents[0].kill_node()
    return killed_at


def stop_all(agents: list[Agent], coordinators: list[Coordinator]) -> None:
    for process in [*agents, *coordinators]:
        process.kill()


def assert_fenced(agents: list[Agent], everyone: list) -> None:
    for agent in agents:
        wait_until(
            lambda a=agent: count([a], "fences itself: no lease renewal") == 1, "the agent to fence", everyone, 30
        )
        for pid in agent.pids.values():
            wait_until(lambda pid=pid: zombie_or_gone(pid), f"rank pid {pid} to die with the fence", everyone, 10)


@pytest.mark.parametrize("host", ["node0", "standalone"])
def test_the_coordinators_host_killed_and_started_again_resumes_from_the_checkpoint(tmp_path, tmp_path_factory, host):
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, checkpointed(tmp_path), "adam")
    standalone = host == "standalone"
    port = free_port()
    job.hold(11)  # bound: the kill comes between the checkpoint at 8 and the end
    agents, coordinators = start(job, port, standalone)
    everyone = [*agents, *coordinators]
    latest = tmp_path / "checkpoints" / "latest"
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 9, "every rank at iteration 9", everyone)
        assert latest.read_text() == "global_step8"
        killed_at = kill_host(agents, coordinators)
        survivors = agents[1:] if not standalone else agents
        assert_fenced(survivors, everyone)
        fenced_at = max(a.events.wait_for("fenced", timeout=5)["time"] for a in survivors)
        for a in survivors:
            a.events.wait_for("coordinator_lost", timeout=10)
        print(f"coordinator's host killed to every agent fenced: {fenced_at - killed_at:.2f} s")
        job.hold(None)
        for path in job.out.glob("progress*"):
            path.unlink()
        time.sleep(1.0)  # the agents wait; nothing hangs meanwhile
        assert all(a.proc.poll() is None for a in survivors)
        back_at = time.time()
        if standalone:
            coordinators.append(Coordinator(job, port, NODES, 2, tag="1"))
        else:
            agents.append(Agent(job, 0, port, NODES, incarnation=1, extra=(*UNSAFE, "--coordinator-wait", "120")))
        everyone = [*agents, *coordinators]
        live = [*survivors, *([] if standalone else agents[-1:])]
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) > 8, "every rank training again", everyone)
        print(f"coordinator back to every rank training again: {time.time() - back_at:.2f} s")
        wait_until(lambda: all(a.proc.poll() is not None for a in live), "the job's end", everyone, 120)
        if standalone:
            wait_until(lambda: coordinators[-1].proc.poll() is not None, "the coordinator's end", everyone, 30)
    except BaseException:
        stop_all(agents, coordinators)
        raise
    for process in [*live, *coordinators[-1:]]:
        assert process.proc.returncode == 0, process.log_tail()
    restarted = coordinators[-1] if standalone else agents[-1]
    assert count([restarted], r"the agents ran generations \{.*\} before: this coordinator runs generation 1") == 1
    for a in survivors:
        assert count([a], r"a coordinator is back at .*: every rank of node \d starts again in generation 1") == 1
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*/*.log"))
    assert logs.count("resumed from checkpoint global_step8") == PP * DP, logs[-3000:]
    assert_final_states(job, reference, STEPS)


def test_without_a_checkpoint_the_restarted_job_stops_with_a_message(tmp_path):
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")  # no recycle.checkpoint
    port = free_port()
    job.hold(6)
    agents, coordinators = start(job, port, standalone=False)
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 2, "every rank at iteration 2", agents)
        kill_host(agents, coordinators)
        assert_fenced(agents[1:], agents)
        job.hold(None)
        agents.append(Agent(job, 0, port, NODES, incarnation=1, extra=(*UNSAFE, "--coordinator-wait", "60")))
        live = [agents[1], agents[2]]
        wait_until(lambda: all(a.proc.poll() is not None for a in live), "both agents to end", agents, 120)
    except BaseException:
        stop_all(agents, coordinators)
        raise
    assert [a.proc.returncode for a in live] == [1, 1]
    assert count(live, r"job stopped before it finished: .*a restart found no checkpoint") == 2
    assert sum(a.events.count("respawned", generation=1) for a in live) == 0, "no respawn loop after the stop"
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("node*.[1-9]/*.log"))
    logs += "\n".join(p.read_text() for p in (tmp_path / "logs").glob("node1.0/*.log"))
    message = "the job restarts in generation 1 (the coordinator's host died, or a stage lost every worker), but no"
    assert logs.count(message + " recycle.checkpoint is configured to resume from: the job stops here") == PP * DP
    assert "Traceback" not in logs.split(message)[-1], logs[-3000:]


def test_when_no_coordinator_comes_back_the_agents_give_up_after_their_wait(tmp_path):
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    port = free_port()
    job.hold(4)
    agents, coordinators = start(job, port, standalone=True, wait="3")
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 1, "every rank at iteration 1", agents)
        killed_at = kill_host(agents, coordinators)
        wait_until(lambda: all(a.proc.poll() is not None for a in agents), "both agents to end", agents, 30)
        ended_at = time.time()
    except BaseException:
        stop_all(agents, coordinators)
        raise
    print(f"coordinator killed to both agents ended (coordinator timeout 2 s, wait 3 s): {ended_at - killed_at:.2f} s")
    for agent in agents:
        assert agent.proc.returncode == 1, agent.log_tail(20)
        assert count([agent], rf"no coordinator at 127.0.0.1:{port} started a generation after 0 within 3 s") == 1
        for pid in agent.pids.values():
            assert zombie_or_gone(pid), f"rank pid {pid} outlived its agent"
