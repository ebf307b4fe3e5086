"""Several nodes on one machine, driven from outside: one ``ds-recycle launch --nnodes N --node-rank
K`` agent per node, each in a process group of its own (a node's crash is that group SIGKILLed), a
standalone ``ds-recycle coordinator`` process, and optionally one network namespace per node
(a partition is a link set down). Every wait is bounded; only processes started here are killed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ds_recycle.testing.jobs import WORKER, Job
from ds_recycle.testing.launch_events import LaunchEvents

JOB_TOKEN = "multinode-test-token-0123456789"


class Watched:
    """A process started in a process group of its own, its output lines read in a thread."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def log_tail(self, lines: int = 40, chars: int = 1500) -> str:
        """Its last output lines (what a failed assertion shows)."""
        return "\n".join(self.lines[-lines:])

    def kill_group(self) -> None:
        """SIGKILL the process's whole group (once; reaped)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class Agent(Watched):
    """One node's ``ds-recycle launch`` process, its output read in a thread, its events watched."""

    def __init__(
        self,
        job: Job,
        node: int,
        port: int,
        nodes: int,
        incarnation: int = 0,
        network: Network | None = None,
        extra: tuple[str, ...] = (),
        per_node: int = 2,
        etcd: tuple[str, ...] = (),
    ) -> None:
        """``etcd``: the job's store is the etcd cluster of these members (``--rdzv-backend etcd``),
        not the c10d store at ``port``."""
        logs = self.logs = job.tmp / "logs" / f"node{node}.{incarnation}"
        self.events = LaunchEvents(job.tmp / f"events{node}.{incarnation}.jsonl")
        command = network.enter(node) if network else []
        command += [sys.executable, "-m", "ds_recycle.cli", "launch", "--nnodes", str(nodes)]
        command += ["--node-rank", str(node), "--nproc-per-node", str(per_node)]
        host = network.address(0) if network else "127.0.0.1"
        if etcd:
            command += ["--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(etcd)]
        else:
            command += ["--rdzv-endpoint", f"{host}:{port}"]
        command += ["--node-lease", "2", "--respawn"]
        command += ["--respawn-delay", "0.2", "--timeout", "300", "--log-dir", str(logs)]
        command += ["--events", str(self.events.path), "--preload", *extra]
        command += [str(WORKER), "--pp", str(job.pp), "--steps", str(job.steps), "--optimizer", "adam"]
        command += ["--config", str(job.tmp / "ds_config.json"), "--out", str(job.out)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_RECYCLE_TOKEN": JOB_TOKEN}
        if network:
            env["GLOO_SOCKET_IFNAME"] = Network.INTERFACE  # gloo's pairs on the node's own link
        super().__init__(command, env)

    def log_tail(self, lines: int = 40, chars: int = 1500) -> str:
        """Its last output lines and the end of each of its ranks' logs (a rank that crashed wrote
        why only there)."""
        text = super().log_tail(lines)
        for path in sorted(self.logs.glob("*.log")):
            text += f"\n--- {path.parent.name}/{path.name} ---\n" + path.read_text(errors="replace")[-chars:]
        return text

    @property
    def pids(self) -> dict[int, int]:
        return self.events.pids()

    def kill_node(self) -> None:
        """A node crash: the agent's whole process group, SIGKILL (its ranks die with it)."""
        self.kill_group()

    def freeze(self, sig: int = signal.SIGSTOP) -> None:
        """A frozen node (power loss seen from outside, a hung kernel): the agent and its ranks stop."""
        os.killpg(self.proc.pid, sig)
        for pid in self.pids.values():
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.kill_group()
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


class Coordinator(Watched):
    """A standalone ``ds-recycle coordinator`` process (a process group of its own), its output read
    in a thread."""

    def __init__(self, job: Job, port: int, nodes: int, per_node: int, tag: str, extra: tuple[str, ...] = ()) -> None:
        self.events = LaunchEvents(job.tmp / f"events_coordinator.{tag}.jsonl")
        command = [sys.executable, "-m", "ds_recycle.cli", "coordinator", "--nnodes", str(nodes)]
        command += ["--nproc-per-node", str(per_node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-lease", "2"]
        command += ["--timeout", "300", "--events", str(self.events.path), *extra]
        super().__init__(command, {**os.environ, "DS_RECYCLE_TOKEN": JOB_TOKEN})

    def kill(self) -> None:
        self.kill_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], bool], what: str, agents: list, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; after ``timeout`` s fail with the agents' last lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if agents and all(a.proc.poll() is not None for a in agents):
            if condition():  # it may have come true as the last agent ended, after the look above
                return
            break  # nothing left to wait for
        time.sleep(0.02)
    raise AssertionError(
        f"every process ended or timed out waiting for {what}:\n" + "\n".join(a.log_tail(30, 800) for a in agents)
    )


def count(agents: list, pattern: str) -> int:
    """Output lines of ``agents`` that match ``pattern``."""
    regex = re.compile(pattern)
    return sum(bool(regex.search(line)) for agent in agents for line in list(agent.lines))


def zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or between the open and the read
        return True
