"""Several nodes on one machine: one ``ds-recycle launch --nnodes 3 --node-rank K`` agent per node,
each in a process group of its own, on loopback. A node is lost as a whole (its agent's process
group SIGKILLed: its ranks die with it) in the middle of an iteration; the survivors go on with the
adapted plan after one change for the node's two ranks; the node's agent is started again with the
same node rank and its two slots re-join from live replicas; the job ends with every parameter and
optimizer state equal to a fault-free run and an exact F ledger.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from ds_recycle.testing.agents import Agent, Network, count, free_port, wait_until, zombie_or_gone
from ds_recycle.testing.jobs import Job, assert_same_as_fault_free, fault_free, job_config

pytestmark = pytest.mark.multiprocess

PP, DP = 2, 3
NODES, PER_NODE = 3, 2
STEPS = 24


def readmit_and_finish(job: Job, agents: list[Agent], lost: int, port: int, network: Network | None = None) -> list:
    """Start the lost node's agent again, wait until both its slots' joins are accepted, release the
    survivors' hold and wait for the job's end; the agents that finished it."""
    agents.append(Agent(job, lost, port, NODES, incarnation=1, network=network))
    coordinator = agents[0].events
    for s in range(lost * PER_NODE, (lost + 1) * PER_NODE):
        wait_until(lambda s=s: coordinator.count("accepted", kind="join", slot=s) == 1, f"slot {s}'s join", agents)
    job.hold(None)
    live = [agent for node, agent in enumerate(agents[:NODES]) if node != lost] + [agents[-1]]
    wait_until(lambda: all(a.proc.poll() is not None for a in live), "the job's end", agents, 240)
    return live


@pytest.mark.parametrize("how", ["sigkill", "freeze"])
def test_a_node_lost_as_a_whole_is_survived_and_readmitted(tmp_path, tmp_path_factory, how):
    """``sigkill``: the node's agent and ranks die (waitpid sees nothing: the survivors' comm errors
    and the node's stale lease tell). ``freeze``: the agent and its ranks are SIGSTOPped, so only the
    lease can tell; when thawed the agent finds its lease lapsed and fences itself."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")  # its records, ledgers and pacing; started below
    port = free_port()
    agents = [Agent(job, node, port, NODES) for node in range(NODES)]
    lost = 2
    lost_slots = [lost * PER_NODE + i for i in range(PER_NODE)]
    assert sorted((s % DP, s // DP) for s in lost_slots) == [(1, 1), (2, 1)]  # stage 1 keeps worker (0, 1)
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 3, "every rank at iteration 3", agents)
        iteration = max(job.progress(s) for s in range(PP * DP))
        job.hold(iteration + 4)
        killed_at = time.time()
        if how == "sigkill":
            agents[lost].kill_node()
        else:
            agents[lost].freeze()
        node_failed = rf"published failure of node {lost}: slots \[{lost_slots[0]}, {lost_slots[1]}\] in one change"
        wait_until(lambda: count(agents[:1], node_failed) == 1, "the node's failure", agents)
        if how == "freeze":
            assert count(agents[:1], rf"lease of node {lost} \(incarnation 1\) lapsed") == 1
            agents[lost].freeze(signal.SIGCONT)
            wait_until(lambda: agents[lost].proc.poll() is not None, "the thawed agent to end", agents)
            assert agents[lost].proc.returncode == 1
            assert count(agents[lost : lost + 1], rf"node {lost} fences itself: no lease renewal") == 1
        survivors = [s for s in range(PP * DP) if s not in lost_slots]
        wait_until(lambda: min(job.progress(s) for s in survivors) > iteration, "survivors on the new plan", agents)
        live = readmit_and_finish(job, agents, lost, port)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    for agent in live:
        assert agent.proc.returncode == 0, agent.log_tail()
    assert count(agents[-1:], rf"node {lost} \(incarnation 2\) re-joins the running job") == 1
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*/*.log")))
    [joined] = {line for line in re.findall(r"ReCycle epoch \d+ from iteration \d+: .*joined \[[^\]]*\]", logs)
                if "joined []" not in line and "(1, 1)" in line.split("joined")[1]}  # fmt: skip
    assert "(2, 1)" in joined.split("joined")[1], f"both slots of the node re-join in one decision: {joined}"
    first = min(_stamp(line) for line in re.findall(r"^\S+ \S+ \[INFO\].*ReCycle epoch 1 from.*$", logs, re.M))
    print(f"node SIGKILL to the first survivor on the new plan: {1e3 * (first - killed_at):.0f} ms")
    assert_same_as_fault_free(job, reference, STEPS)


def _stamp(line: str) -> float:
    """The wall time of a DeepSpeed log line ``[YYYY-mm-dd HH:MM:SS,mmm] ...``."""
    import datetime

    text = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", line).group(1)
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_layout_in_which_a_node_holds_every_replica_of_a_stage_is_refused_at_start(tmp_path):
    """pp=2 x dp=2 on 2 nodes of 2 with DeepSpeed's stage-major numbering: node 0 holds both
    workers of stage 0. Every rank refuses before its first iteration, naming the node, the stage and
    the fix, and the launchers end (no respawn loop)."""
    job = Job(tmp_path, 2, 2, STEPS, job_config(), "adam")
    port = free_port()
    agents = [Agent(job, node, port, 2) for node in range(2)]
    try:
        wait_until(lambda: all(a.proc.poll() is not None for a in agents), "both agents to end", agents, 180)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    assert [a.proc.returncode for a in agents] == [1, 1]
    assert count(agents, "respawned") == 0
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*/*.log")))
    refusals = re.findall(r"refuses to start: (node \d+ holds every replica of stage \d+)", logs)
    assert refusals and set(refusals) == {"node 0 holds every replica of stage 0"}, logs[-3000:]
    assert "pipeline_major_topology(P, D)" in logs and "--allow-unsafe-placement" in logs
    assert job.progress(0) == 0, "no iteration ran"


def test_a_failure_domain_holding_every_replica_of_a_stage_is_refused_at_start(tmp_path):
    """pp=2 x dp=3 on 3 nodes of 2, stage-major: no node holds every replica of a stage (node 1 has
    one of each), but nodes 0 and 1 share a rack (``--domain rackA``) that holds all of stage 0.
    Every rank refuses before its first iteration, naming the domain, its nodes and the stage."""
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    port = free_port()
    racks = ["rackA", "rackA", "rackB"]
    agents = [Agent(job, node, port, NODES, extra=("--domain", racks[node])) for node in range(NODES)]
    try:
        wait_until(lambda: all(a.proc.poll() is not None for a in agents), "every agent to end", agents, 180)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    assert [a.proc.returncode for a in agents] == [1, 1, 1]
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*/*.log")))
    refusals = re.findall(
        r"refuses to start: (domain \S+ \(nodes \[[\d, ]+\]\) holds every replica of stage \d+)", logs
    )
    assert len(refusals) == PP * DP, logs[-3000:]
    assert set(refusals) == {"domain rackA (nodes [0, 1]) holds every replica of stage 0"}, logs[-3000:]
    assert job.progress(0) == 0, "no iteration ran"


def test_a_partitioned_node_fences_itself_and_the_survivors_go_on(tmp_path, tmp_path_factory):
    """One network namespace per node. Node 2's link goes down in the middle of training: nothing
    dies and no socket is reset, so only the lease can tell. Node 2's agent cannot renew, fences
    itself (kills its ranks) and ends; the coordinator fails the node's two slots in one change and
    the survivors go on without them. The link comes back, the node's agent is started again, both
    slots re-join, and the job ends equal to a fault-free run."""
    reason = Network.unavailable()
    if reason:
        pytest.skip(reason)
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    network = Network(NODES)
    port = free_port()
    agents = [Agent(job, node, port, NODES, network=network) for node in range(NODES)]
    lost = 2
    lost_slots = [lost * PER_NODE + i for i in range(PER_NODE)]
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 3, "every rank at iteration 3", agents)
        iteration = max(job.progress(s) for s in range(PP * DP))
        job.hold(iteration + 4)
        network.cut(lost)
        cut_at = time.time()
        node_failed = rf"published failure of node {lost}: slots \[{lost_slots[0]}, {lost_slots[1]}\] in one change"
        wait_until(lambda: count(agents[:1], node_failed) == 1, "the node's failure", agents)
        fenced = rf"node {lost} fences itself: no lease renewal"
        wait_until(lambda: count(agents[lost : lost + 1], fenced) == 1, "the cut-off agent to fence itself", agents)
        for pid in agents[lost].pids.values():
            wait_until(lambda pid=pid: zombie_or_gone(pid), f"rank pid {pid} of the fenced node to end", agents, 10)
        survivors = [s for s in range(PP * DP) if s not in lost_slots]
        wait_until(lambda: min(job.progress(s) for s in survivors) > iteration, "survivors on the new plan", agents)
        published = agents[0].events.wait_for("published_failure", 1, timeout=10, slot=lost_slots[0])
        print(f"link down to the node's failure published: {published['time'] - cut_at:.2f} s (lease 2 s)")
        # Cut off, the agent cannot tell a partition from the coordinator's loss: it waits for a
        # coordinator. Once the link is back it finds the same generation running and ends.
        network.cut(lost, up=True)
        wait_until(lambda: agents[lost].proc.poll() is not None, "the reconnected agent to end", agents)
        assert agents[lost].proc.returncode == 1, agents[lost].log_tail(20)
        assert count(agents[lost : lost + 1], r"still runs generation 0, so the job went on without this node") == 1
        live = readmit_and_finish(job, agents, lost, port, network)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    finally:
        network.remove()
    for agent in live:
        assert agent.proc.returncode == 0, agent.log_tail()
    assert_same_as_fault_free(job, reference, STEPS)
