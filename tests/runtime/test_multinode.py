"""Several nodes on one machine: one ``ds-recycle launch --nnodes 3 --node-rank K`` agent per node,
each in a process group of its own, on loopback. A node is lost as a whole (its agent's process
group SIGKILLed: its ranks die with it) in the middle of an iteration; the survivors go on with the
adapted plan after one change for the node's two ranks; the node's agent is started again with the
same node rank and its two slots re-join from live replicas; the job ends with every parameter and
optimizer state equal to a fault-free run and an exact F ledger.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ds_recycle.testing.jobs import WORKER, Job, assert_same_as_fault_free, fault_free, job_config
from ds_recycle.testing.launch_events import LaunchEvents

pytestmark = pytest.mark.multiprocess

PP, DP = 2, 3
NODES, PER_NODE = 3, 2
STEPS = 24
TOKEN = "multinode-test-token-0123456789"


class Agent:
    """One node's ``ds-recycle launch`` process, its output read in a thread, its events watched."""

    def __init__(
        self,
        job: Job,
        node: int,
        port: int,
        incarnation: int = 0,
        nodes: int = NODES,
        network: Network | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        logs = job.tmp / "logs" / f"node{node}.{incarnation}"
        self.events = LaunchEvents(job.tmp / f"events{node}.{incarnation}.jsonl")
        command = network.enter(node) if network else []
        command += [sys.executable, "-m", "ds_recycle.cli", "launch", "--nnodes", str(nodes)]
        command += ["--node-rank", str(node), "--nproc-per-node", str(PER_NODE)]
        host = network.address(0) if network else "127.0.0.1"
        command += ["--rdzv-endpoint", f"{host}:{port}", "--node-lease", "2", "--respawn"]
        command += ["--respawn-delay", "0.2", "--timeout", "300", "--log-dir", str(logs)]
        command += ["--events", str(self.events.path), *extra]
        command += [str(WORKER), "--pp", str(job.pp), "--steps", str(STEPS), "--optimizer", "adam"]
        command += ["--config", str(job.tmp / "ds_config.json"), "--out", str(job.out)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_RECYCLE_TOKEN": TOKEN}
        if network:
            env["GLOO_SOCKET_IFNAME"] = Network.INTERFACE  # gloo's pairs on the node's own link
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pids(self) -> dict[int, int]:
        return self.events.pids()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def kill_node(self) -> None:
        """A node crash: the agent's whole process group, SIGKILL (its ranks die with it)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def freeze(self, sig: int = signal.SIGSTOP) -> None:
        """A frozen node (power loss seen from outside, a hung kernel): the agent and its ranks stop."""
        os.killpg(self.proc.pid, sig)
        for pid in self.pids.values():
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Network:
    """One network namespace per node, each with a veth link to a bridge in a hub namespace, on an
    address of the benchmarking range 198.18.0.0/15: a partition is a link set down (packets are
    dropped, no RST: peers see a blackhole, as on a real cut). Only namespaces made here are
    created and deleted."""

    INTERFACE = "drt0"

    def __init__(self, nodes: int) -> None:
        tag = os.getpid() % 100000
        self.subnet = f"198.18.{tag % 250}"
        self.hub = f"drt{tag}h"
        self.names = [f"drt{tag}n{k}" for k in range(nodes)]
        self.made: list[str] = []
        try:
            self._ip("netns", "add", self.hub)
            self.made.append(self.hub)
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                self._ip("netns", "add", name)
                self.made.append(name)
                self._ip(
                    "link",
                    "add",
                    self.INTERFACE,
                    "netns",
                    name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"h{k}",
                    "netns",
                    self.hub,
                )
                self._ip("-n", self.hub, "link", "set", f"h{k}", "master", "br0")
                self._ip("-n", self.hub, "link", "set", f"h{k}", "up")
                self._ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", self.INTERFACE)
                self._ip("-n", name, "link", "set", self.INTERFACE, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def enter(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[node]]

    def cut(self, node: int, up: bool = False) -> None:
        """The node's link down (a partition) or up again."""
        self._ip("-n", self.hub, "link", "set", f"h{node}", "up" if up else "down")

    def remove(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need CAP_NET_ADMIN (run as root)"
        probe = f"drt{os.getpid() % 100000}probe"
        try:
            done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            return "the `ip` command (iproute2) is not installed"
        if done.returncode != 0:
            return f"`ip netns add` failed: {done.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, what: str, agents: list[Agent], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(line for a in agents for line in a.lines[-30:]))


def readmit_and_finish(job: Job, agents: list[Agent], lost: int, port: int, network: Network | None = None) -> list:
    """Start the lost node's agent again, wait until both its slots' joins are accepted, release the
    survivors' hold and wait for the job's end; the agents that finished it."""
    agents.append(Agent(job, lost, port, incarnation=1, network=network))
    coordinator = agents[0].events
    for s in range(lost * PER_NODE, (lost + 1) * PER_NODE):
        wait_until(lambda s=s: coordinator.count("accepted", kind="join", slot=s) == 1, f"slot {s}'s join", agents)
    job.hold(None)
    live = [agent for node, agent in enumerate(agents[:NODES]) if node != lost] + [agents[-1]]
    wait_until(lambda: all(a.proc.poll() is not None for a in live), "the job's end", agents, 240)
    return live


def count(agents: list[Agent], pattern: str) -> int:
    regex = re.compile(pattern)
    return sum(bool(regex.search(line)) for agent in agents for line in list(agent.lines))


@pytest.mark.parametrize("how", ["sigkill", "freeze"])
def test_a_node_lost_as_a_whole_is_survived_and_readmitted(tmp_path, tmp_path_factory, how):
    """``sigkill``: the node's agent and ranks die (waitpid sees nothing: the survivors' comm errors
    and the node's stale lease tell). ``freeze``: the agent and its ranks are SIGSTOPped, so only the
    lease can tell; when thawed the agent finds its lease lapsed and fences itself."""
    reference = fault_free(tmp_path_factory, PP, DP, STEPS, "adam")
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")  # its records, ledgers and pacing; started below
    port = free_port()
    agents = [Agent(job, node, port) for node in range(NODES)]
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
        assert agent.proc.returncode == 0, "\n".join(agent.lines[-40:])
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


def test_when_the_coordinators_host_dies_every_node_stops_and_nothing_hangs(tmp_path):
    """Node 0 hosts the store and the coordinator. Its loss is not survived in place (that needs a
    replicated store): every other agent notices within its lease, fences its ranks and ends with
    an error, bounded in time."""
    job = Job(tmp_path, PP, DP, STEPS, job_config(), "adam")
    port = free_port()
    agents = [Agent(job, node, port) for node in range(NODES)]
    try:
        wait_until(lambda: min(job.progress(s) for s in range(PP * DP)) >= 2, "every rank at iteration 2", agents)
        agents[0].kill_node()
        lost_at = time.monotonic()
        wait_until(lambda: all(a.proc.poll() is not None for a in agents[1:]), "every other node to stop", agents, 60)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    print(f"coordinator's host killed: every other node stopped within {time.monotonic() - lost_at:.1f} s")
    for agent in agents[1:]:
        assert agent.proc.returncode == 1, "\n".join(agent.lines[-20:])
        assert any("fences itself" in line for line in agent.lines), "\n".join(agent.lines[-20:])
        for pid in agent.pids.values():
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"rank pid {pid} outlived its node"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_layout_in_which_a_node_holds_every_replica_of_a_stage_is_refused_at_start(tmp_path):
    """pp=2 x dp=2 on 2 nodes of 2 with DeepSpeed's stage-major numbering: node 0 holds both
    workers of stage 0. Every rank refuses before its first iteration, naming the node, the stage and
    the fix, and the launchers end (no respawn loop)."""
    job = Job(tmp_path, 2, 2, STEPS, job_config(), "adam")
    port = free_port()
    agents = [Agent(job, node, port, nodes=2) for node in range(2)]
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
    agents = [Agent(job, node, port, extra=("--domain", racks[node])) for node in range(NODES)]
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
    agents = [Agent(job, node, port, network=network) for node in range(NODES)]
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
        wait_until(lambda: agents[lost].proc.poll() is not None, "the cut-off agent to end", agents)
        assert agents[lost].proc.returncode == 1, "\n".join(agents[lost].lines[-20:])
        assert count(agents[lost : lost + 1], rf"node {lost} fences itself: no lease renewal") == 1
        for pid in agents[lost].pids.values():
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"rank pid {pid} outlived its fenced node"
        survivors = [s for s in range(PP * DP) if s not in lost_slots]
        wait_until(lambda: min(job.progress(s) for s in survivors) > iteration, "survivors on the new plan", agents)
        published = agents[0].events.wait_for("published_failure", 1, timeout=10, slot=lost_slots[0])
        print(f"link down to the node's failure published: {published['time'] - cut_at:.2f} s (lease 2 s)")
        network.cut(lost, up=True)
        live = readmit_and_finish(job, agents, lost, port, network)
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    finally:
        network.remove()
    for agent in live:
        assert agent.proc.returncode == 0, "\n".join(agent.lines[-40:])
    assert_same_as_fault_free(job, reference, STEPS)
