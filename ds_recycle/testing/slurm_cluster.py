"""A real Slurm cluster on one machine, for the tests and for a person (scripts/slurm_cluster.sh):
munged, slurmctld and N slurmd "nodes" of 2 CPUs each, Debian's Slurm 22.05 as it is packaged.

Why namespaces: Debian's Slurm is built with ``--enable-multiple-slurmd`` (``scontrol show
config`` says ``MULTIPLE_SLURMD = Yes``), so several slurmd could share this host on ports of their
own; but then every "node" would have the same host name and address, the batch script's endpoint
(``scontrol show hostnames | head -1``) would be this host, and a node's processes could not be
told apart or cut off as a whole. Each node therefore gets a network namespace of its own on a
bridge (addresses in the benchmarking range 198.18.0.0/15, never on a real interface), and a UTS
and a mount namespace of its own in which its host name is set and ``/etc/hosts`` (a file of the
cluster's) is bind-mounted, so that ``n0`` resolves on every node as on a real cluster. slurmctld
runs the same way in the bridge's namespace (host ``ctl``), and the client commands (``sbatch``,
``scontrol``, ``srun --jobid``) enter its namespaces. No cgroup plugin is used
(``proctrack/linuxproc``: a step's signal reaches every process under its task; ``task/none``);
munged has a key and a socket of the cluster's own.

Accounting: Debian's slurmdbd needs MySQL, which is not here, so ``AccountingStorageType`` is
``accounting_storage/none`` (``sacct`` then answers "Slurm accounting storage is disabled") and a
job's end is read from ``jobcomp/filetxt`` (one line per finished job, with its state) and
``scontrol show job`` (kept for ``MinJobAge`` seconds after its end).

A node's loss is every process in its network namespace SIGKILLed (slurmd, slurmstepd, the
task and its ranks); :meth:`SlurmCluster.start_slurmd` brings its slurmd back. Everything started
here is stopped by PID (every process in the cluster's namespaces, and munged), and only the
namespaces made here are deleted. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
"""Debian's packages with slurmctld, slurmd, the client commands (slurm-client) and munged."""
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "munged")
TOOLS = ("ip", "nsenter", "unshare", "openssl")
"""iproute2, util-linux (namespaces) and openssl (the batch script's token): on every Debian."""
CPUS_PER_NODE = 2
START_TIMEOUT_SECONDS = 60.0
COMMAND_TIMEOUT_SECONDS = 30.0
SLURMD_TIMEOUT_SECONDS = 6
"""``SlurmdTimeout``: a node whose slurmd has not answered for this long is set DOWN."""
KILL_WAIT_SECONDS = 30
"""``KillWait`` (Slurm's default): SIGTERM to the tasks at a cancel or requeue, SIGKILL this later."""


def unavailable() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if sys.platform != "linux":
        return "a Slurm cluster in namespaces needs Linux"
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (network, UTS and mount namespaces; slurmd runs as root)"
    missing = [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install {' '.join(PACKAGES)})"
    missing = [name for name in TOOLS if shutil.which(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install iproute2 util-linux openssl)"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """The cluster's files live in ``root``: slurm.conf, the munge key and socket, the hosts file,
    the state and spool directories, the daemons' logs and ``cluster.json`` (what was started, so
    that another process, scripts/slurm_cluster.sh stop, can stop it)."""

    root: Path
    nodes: int = 3
    tag: str = ""
    """Names the namespaces (``drs<tag>h``, ``drs<tag>n<k>``) and the subnet; default from the PID."""
    pids: dict[str, int] = field(default_factory=dict)
    """Daemon name (``munged``, ``slurmctld``, ``slurmd.n0``...) -> PID."""
    namespaces: list[str] = field(default_factory=list)
    """The network namespaces made here (deleted at :meth:`stop`)."""

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.tag = self.tag or str(os.getpid() % 100000)
        self.subnet = f"198.19.{int(self.tag) % 250}"
        self.hub = f"drs{self.tag}h"

    # ---- names and places ------------------------------------------------------------------------

    def node_name(self, node: int) -> str:
        return f"n{node}"

    def namespace(self, node: int) -> str:
        return f"drs{self.tag}n{node}"

    def address(self, node: int) -> str:
        """A node's address (the controller's is ``.1``)."""
        return f"{self.subnet}.{node + 2}"

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client command (and, through sbatch's ``--export=ALL``, of a job)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- start and stop --------------------------------------------------------------------------

    def start(self, guard: bool = False) -> SlurmCluster:
        """Make the namespaces, write the configuration, start munged, slurmctld and every slurmd,
        and wait (bounded) until every node is idle. On any error everything started is stopped.
        ``guard``: a watchdog process stops the cluster once this process has ended, however it
        ended (a test run ended by its timeout skips its fixtures' teardown)."""
        try:
            if guard:
                self._root_dirs()
                command = [sys.executable, "-m", "ds_recycle.testing.slurm_cluster", "guard", str(self.root)]
                self._spawn("guard", [*command, str(os.getpid())], plain=True)
            self._root_dirs()
            self._network()
            self._write_config()
            self._start_munged()
            self._start_slurmctld()
            for node in range(self.nodes):
                self.start_slurmd(node)
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _root_dirs(self) -> None:
        for sub in ("state", "log", "munge", *(f"spool/{self.node_name(k)}" for k in range(self.nodes))):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def stop(self) -> None:
        """SIGKILL every process in the cluster's namespaces (daemons, steps, tasks, clients), then
        munged and the watchdog, by PID; delete the namespaces made here."""
        guard = self.pids.pop("guard", None)
        if guard is not None and guard != os.getpid():
            _kill(guard)
        for name in [self.hub, *(self.namespace(k) for k in range(self.nodes))]:
            if name in self.namespaces:
                self._kill_namespace(name)
        munged = self.pids.pop("munged", None)
        if munged is not None:
            _kill(munged)
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.namespaces.clear()
        self.pids.clear()
        self._save()

    def _network(self) -> None:
        self._add_namespace(self.hub)
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "addr", "add", f"{self.subnet}.1/24", "dev", "br0")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        self._ip("-n", self.hub, "link", "set", "lo", "up")
        for k in range(self.nodes):
            name = self.namespace(k)
            self._add_namespace(name)
            self._ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"v{k}", "netns", self.hub)
            self._ip("-n", self.hub, "link", "set", f"v{k}", "master", "br0")
            self._ip("-n", self.hub, "link", "set", f"v{k}", "up")
            self._ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            self._ip("-n", name, "link", "set", "eth0", "up")
            self._ip("-n", name, "link", "set", "lo", "up")
        hosts = ["127.0.0.1 localhost", f"{self.subnet}.1 ctl"]
        hosts += [f"{self.address(k)} {self.node_name(k)}" for k in range(self.nodes)]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _add_namespace(self, name: str) -> None:
        self._ip("netns", "add", name)
        self.namespaces.append(name)
        self._save()

    def _write_config(self) -> None:
        root = self.root
        nodes = "\n".join(
            f"NodeName={self.node_name(k)} NodeAddr={self.address(k)} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for k in range(self.nodes)
        )
        self.conf.write_text(
            f"""# A test cluster of ds_recycle.testing.slurm_cluster: {self.nodes} nodes in network namespaces.
ClusterName=drs{self.tag}
SlurmctldHost=ctl({self.subnet}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_SECONDS}
SlurmctldTimeout=30
KillWait={KILL_WAIT_SECONDS}
MinJobAge=3600
InactiveLimit=0
JobRequeue=1
PlugStackConfig={root}/plugstack.conf
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        (root / "plugstack.conf").write_text("")  # the host's /etc/slurm/plugstack.conf is not ours

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        munge.chmod(0o700)
        command = [_daemon("munged"), "--foreground", "--force", f"--socket={munge}/munge.socket"]
        command += [f"--key-file={key}", f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed"]
        command += [f"--log-file={self.root}/log/munged.log"]
        self._spawn("munged", command)
        self._wait(lambda: (munge / "munge.socket").exists(), "munged's socket", "munged")

    def _start_slurmctld(self) -> None:
        command = self._inside(self.hub, "ctl", [_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmctld", command)
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld", "slurmctld")

    def start_slurmd(self, node: int) -> None:
        """Start (or start again) node ``node``'s slurmd in its namespaces."""
        name = self.node_name(node)
        command = self._inside(self.namespace(node), name, [_daemon("slurmd"), "-D", "-f", str(self.conf)])
        self._spawn(f"slurmd.{name}", command)

    def wait_idle(self, nodes: list[int] | None = None, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Until ``nodes`` (default all) are idle (no job), bounded."""
        wanted = {self.node_name(k) for k in (range(self.nodes) if nodes is None else nodes)}

        def idle() -> bool:
            states = self.node_states()
            return all(states.get(n, "").startswith("IDLE") for n in wanted)

        self._wait(idle, f"nodes {sorted(wanted)} idle", "slurmctld", timeout)

    def _inside(self, namespace: str, host: str, command: list[str]) -> list[str]:
        """``command`` in network namespace ``namespace`` and a UTS and mount namespace of its own
        with host name ``host`` and the cluster's hosts file as /etc/hosts."""
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "--propagation", "private",
                "/bin/sh", "-c", script, host, str(self.root / "hosts"), *command]  # fmt: skip

    def _spawn(self, name: str, command: list[str], plain: bool = False) -> None:
        """Start a daemon in a session of its own, its output to log/NAME.out (``plain``: with this
        process's environment, for the watchdog)."""
        log = open(self.root / "log" / f"{name}.out", "ab")
        with log:
            env = os.environ if plain else self.env
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.root
            )
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        state = {"root": str(self.root), "nodes": self.nodes, "tag": self.tag}
        state |= {"pids": self.pids, "namespaces": self.namespaces}
        (self.root / "cluster.json").write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, root: Path) -> SlurmCluster:
        """The cluster started in ``root`` by another process (scripts/slurm_cluster.sh)."""
        state = json.loads((Path(root) / "cluster.json").read_text())
        return cls(Path(state["root"]), state["nodes"], state["tag"], state["pids"], state["namespaces"])

    # ---- commands --------------------------------------------------------------------------------

    def client(self, command: list[str]) -> list[str]:
        """``command`` as run on the controller's host (its network, UTS and mount namespaces)."""
        pid = self.pids["slurmctld"]
        return ["nsenter", "-t", str(pid), "--net", "--uts", "--mount", *command]

    def run(
        self,
        command: list[str],
        check: bool = True,
        timeout: float = COMMAND_TIMEOUT_SECONDS,
        env: dict[str, str] | None = None,
        **kwargs,
    ) -> subprocess.CompletedProcess:
        """Run a client command on the controller's host (``env``: more variables); with ``check``,
        fail with its output."""
        done = subprocess.run(
            self.client(command),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done

    def node_states(self) -> dict[str, str]:
        """Node name -> its state as ``sinfo`` prints it (``IDLE``, ``ALLOCATED``, ``DOWN*``...)."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        return {n: s.upper() for n, s in (line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)}

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of a job ({} once slurmctld forgot it)."""
        done = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def steps(self, job_id: int) -> list[dict[str, str]]:
        """``scontrol show step`` of each running step of the job."""
        done = self.run(["scontrol", "-o", "show", "step", str(job_id)], check=False)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if "StepId=" in line]

    def completed(self, job_id: int) -> dict[str, str] | None:
        """The job's line in the jobcomp/filetxt log (its fields), once it ended; None before."""
        path = self.root / "jobcomp.txt"
        if not path.exists():
            return None
        found = None
        for line in path.read_text().splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == str(job_id):
                found = fields  # a requeued job has a line per run: the last one
        return found

    def sbatch(self, script: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (``env``: more variables of the job's environment); its job ID."""
        done = self.run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, env=env)
        return int(done.stdout.strip().split(";")[0])

    def wait_job(self, job_id: int, states: set[str], timeout: float, what: str = "") -> dict[str, str]:
        """Until ``scontrol show job`` says the job's state is one of ``states``; its fields."""
        seen: dict[str, str] = {}

        def reached() -> bool:
            nonlocal seen
            seen = self.job(job_id)
            return seen.get("JobState") in states

        self._wait(reached, what or f"job {job_id} {sorted(states)}", "slurmctld", timeout)
        return seen

    # ---- a node's processes ----------------------------------------------------------------------

    def node_pids(self, node: int) -> list[int]:
        """Every process in node ``node``'s network namespace (its slurmd, steps, tasks, ranks)."""
        return _in_namespace(self.namespace(node))

    def task_pids(self, node: int) -> list[int]:
        """The processes of the job steps on node ``node``: every process in its namespace but
        slurmd and slurmstepd (the tasks and everything they started)."""
        found = []
        for pid in self.node_pids(node):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if name not in ("slurmd", "slurmstepd"):
                found.append(pid)
        return found

    def popen(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a client command (``srun``) on the controller's host in the background, its
        output to ``log``; it is in the controller's namespace, so :meth:`stop` ends it too."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.client(command),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )

    def kill_node(self, node: int) -> list[int]:
        """A node's loss: SIGKILL every process in its namespace (slurmd, slurmstepd, the task and
        its ranks at once); returns their PIDs."""
        killed = self._kill_namespace(self.namespace(node))
        self.pids.pop(f"slurmd.{self.node_name(node)}", None)
        self._save()
        return killed

    def _kill_namespace(self, name: str) -> list[int]:
        killed: list[int] = []
        for _ in range(50):  # a process forked while the first ones die is caught by the next pass
            found = _in_namespace(name)
            if not found:
                break
            for pid in found:
                _kill(pid, wait=False)
            killed += found
            time.sleep(0.05)
        for pid in self.pids.values():
            _reap(pid)
        return sorted(set(killed))

    # ---- helpers ---------------------------------------------------------------------------------

    def _wait(self, condition, what: str, log: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            pid = self.pids.get(log)
            if pid is not None and not _alive(pid):
                raise RuntimeError(f"{log} ended while waiting for {what}:\n{self.log_tail(log)}")
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.log_tail(log)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a daemon's log (``slurmctld``, ``slurmd.n0``, ``munged``)."""
        text = ""
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.exists():
                text += f"--- {path.name} ---\n" + path.read_text(errors="replace")[-chars:]
        return text

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _in_namespace(name: str) -> list[int]:
    try:
        inode = os.stat(f"/run/netns/{name}").st_ino
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return found


def _alive(pid: int) -> bool:
    """``pid`` runs (neither gone nor a zombie); a zombie child of this process is reaped."""
    _reap(pid)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _kill(pid: int, wait: bool = True) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if wait:
        _reap(pid)


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is a child of this process that ended (a no-op otherwise)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def guard(root: Path, pid: int) -> None:
    """Stop the cluster in ``root`` once process ``pid`` has ended."""
    while _alive(pid):
        time.sleep(0.5)
    cluster = SlurmCluster.load(root)
    cluster.pids.pop("guard", None)
    cluster.stop()


def main(argv: list[str]) -> int:
    """``start DIR [NODES]`` / ``stop DIR`` / ``env DIR`` (scripts/slurm_cluster.sh); ``guard DIR
    PID`` is the watchdog of :meth:`SlurmCluster.start`."""
    if len(argv) == 3 and argv[0] == "guard":
        guard(Path(argv[1]), int(argv[2]))
        return 0
    if len(argv) < 2 or argv[0] not in ("start", "stop", "env"):
        print("usage: slurm_cluster.py start DIR [NODES] | stop DIR | env DIR", file=sys.stderr)
        return 2
    root = Path(argv[1])
    if argv[0] == "start":
        reason = unavailable()
        if reason:
            print(f"cannot start a Slurm cluster: {reason}", file=sys.stderr)
            return 1
        root.mkdir(parents=True, exist_ok=True)
        cluster = SlurmCluster(root, int(argv[2]) if len(argv) > 2 else 3).start()
        print(f"started: {cluster.nodes} nodes {cluster.node_states()}, files in {cluster.root}")
        return 0
    cluster = SlurmCluster.load(root)
    if argv[0] == "stop":
        cluster.stop()
        print(f"stopped the cluster in {cluster.root}")
        return 0
    print(f"export SLURM_CONF={cluster.conf}")
    print(f"# a client command on the controller's host: {' '.join(cluster.client(['sinfo']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
