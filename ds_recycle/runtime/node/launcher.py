"""The agent of one node: it starts one process per rank, hosts the coordinator store (node 0, by
default) or joins it, and keeps survivors alive.

DeepSpeed's launcher kills every local rank as soon as one exits non-zero. This one lets each rank
end on its own, can start a rank that ended again (``respawn``) so that it re-joins, and bounds the
whole run by a timeout. It kills only the processes it started: each rank runs in its own session,
so a rank's children go with it.

:class:`Launcher` runs one job (``ds-recycle launch``, docs/runtime.md); :func:`launch` is the
programmatic form the tests use. The launcher:

- on node 0 (without ``external_coordinator``) hosts the job's store and coordinator
  (:class:`~ds_recycle.runtime.control.host.CoordinatorHost`: the generation's keys are written before any
  rank starts) and tells the coordinator about every start and every exit it observes through
  waitpid; on every other node (every node, with a standalone ``ds-recycle coordinator``) waits
  for the coordinator's generation and tells it through a :class:`~ds_recycle.runtime.node.link.NodeLink`;
- when the coordinator's host dies (its link fences the node after ``coordinator_timeout``), waits
  up to ``coordinator_wait`` for a coordinator back at the endpoint and starts every rank again in
  the generation it runs, from the latest checkpoint (a rank of a generation > 0 that finds none
  stops the job with a message);
- prints one line per event: ``rank R pid P started``, ``rank R exited (code C | signal NAME)``,
  ``rank R respawned (incarnation k)``, and the coordinator's lines;
- with ``events`` (``--events FILE``), also writes each event as one JSON line for programs that
  watch the job (:data:`EVENTS` lists them).

Exit rules: the job is *finished* when a rank that is still a member exits 0 (it completed
training); there are no respawns after that. With ``respawn``, a rank that ends before the job is
finished is started again after ``respawn_delay`` with its incarnation + 1; one that keeps failing
soon after its start waits twice as long each time, and is given up past ``max_restarts``. A rank exiting with
``RESTART_EXIT_CODE`` asks for a restart of the whole job from its checkpoint: once every rank has
ended, all ranks start again in generation + 1 (with ``respawn``), or the launcher ends (without).
The exit code is 0 iff the job finished and every rank that was a member at the end exited 0;
124 on timeout; 75 when a restart was requested without ``respawn``; 128 + signal when the launcher
was interrupted; 1 otherwise (a fenced node whose coordinator did not come back included).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ds_recycle.runtime.control.coordinator import Coordinator, HeartbeatPolicy, RankExit, describe_returncode
from ds_recycle.runtime.control.host import CoordinatorHost, HostConfig, NodesMissing, raise_descriptor_limit
from ds_recycle.runtime.control.succession import Succession
from ds_recycle.runtime.node.link import CoordinatorGone, NodeLink, NodeRefused, await_generation
from ds_recycle.runtime.node.node_watch import NodeWatch
from ds_recycle.runtime.node.preload import PreloadedProcess, Preloader, PreloadError, check_argv, die_with_parent
from ds_recycle.runtime.shared import keys, transport
from ds_recycle.runtime.shared.beats import make_beat_directory
from ds_recycle.runtime.shared.records import Membership

TIMEOUT_EXIT_CODE = 124
FAILURE_EXIT_CODE = 1
POLL_SECONDS = 0.002
"""The waitpid poll period: detection latency of a death is at most this plus the coordinator's tick."""
LOG_PREFIX = "[ds-recycle launch]"
EVENTS = {
    "store": "host, port: the store listens",
    "started": "slot, pid, incarnation, generation: a rank's process started",
    "respawned": "slot, pid, incarnation, generation: ... and it is a respawn (incarnation > 0)",
    "exited": "slot, pid, incarnation, code, signal: waitpid saw it end (code None if a signal ended it)",
    "completed": "slot: a member exited 0, the job is finished",
    "restart_requested": "slot: a rank asked for a restart of the job from its checkpoint",
    "restarting": "generation: every rank starts again from the checkpoint",
    "stopped": "slot: a rank stopped the job (training cannot go on in place)",
    "given_up": "slot, failures: a slot that keeps failing is not respawned again",
    "retired": "slot, why: the coordinator published that a slot will not be started again (--rebalance)",
    "moved": "slot, target, local_rank: a mover left its slot; a process for target starts on its device",
    "published_failure": "slot, cause (exit, heartbeat, probe, node), why, epoch[, node, latency_ms]",
    "accepted": "kind (join, leave, move), slot, pid[, target]: the coordinator accepted a request",
    "refused": "index, kind, slot, pid, reason: ... or refused one",
    "probe": "slot, pid, epoch, ended: a member found a peer gone with no failure published",
    "skipped_request": "index",
    "refused_report": "node, reason",
    "coordinator_error": "error",
    "lease_checks_delayed": "seconds",
    "fenced": "node, why",
    "coordinator_lost": "node, generation, wait: a fenced node waits for a coordinator back at the endpoint",
    "refused_check_in": "node: a check-in with the wrong token",
    "node_refused": "why",
    "timeout": "seconds",
    "interrupted": "signal",
    "ended": "code: the launcher's exit code (the last event)",
}
"""``--events``: one JSON object per line, ``{"event": NAME, "time": wall seconds, FIELDS...}``."""
OTHER_NODES_GRACE_SECONDS = 60.0
DEFAULT_COORDINATOR_TIMEOUT = 3.0
START_WAIT_SECONDS = 60.0
"""An agent waits at least this long for the coordinator at the job's start."""


class EventStream:
    """``--events FILE``: one JSON line per event (:data:`EVENTS`), written and flushed at once;
    nothing without a file. Truncated at :meth:`open`; ``ended`` is the last event."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = None
        self._lock = threading.Lock()

    def open(self) -> EventStream:
        if self.path is not None:
            self._file = open(self.path, "w")  # noqa: SIM115 (closed by close())
        return self

    def emit(self, event: str, **fields: object) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
                self._file.flush()

    def close(self, code: int | None) -> None:
        self.emit("ended", code=code)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    """None if the rank was still running at the timeout and was killed."""
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``ds-recycle launch`` takes; validated by the CLI before anything starts."""

    argv: list[str]
    """The script and its arguments, run as ``python argv...``."""
    nproc: int
    """Ranks on this node (``--nproc`` or ``--nproc-per-node``)."""
    nnodes: int = 1
    node_rank: int = 0
    endpoint: tuple[str, int] | None = None
    """Where node 0's agent hosts the store (``--rdzv-endpoint``); None: one node, any free port."""
    node_lease: float = 5.0
    """A node whose agent has not renewed its lease for this long is failed as a whole."""
    external_coordinator: bool = False
    """A ``ds-recycle coordinator`` hosts the store at ``endpoint``: node 0's agent joins it too."""
    etcd: tuple[str, ...] | None = None
    """The job's store is etcd, at these members' ``host:port`` (``--rdzv-backend etcd``): no agent
    hosts a store, and the coordinator's role passes from agent to agent
    (:mod:`ds_recycle.runtime.control.succession`). None: the c10d store at ``endpoint``."""
    coordinator_timeout: float | None = None
    """An agent that could not reach the coordinator for this long fences its ranks (at most
    ``node_lease``; None: DEFAULT_COORDINATOR_TIMEOUT or ``node_lease`` if shorter)."""
    coordinator_wait: float = 600.0
    """How long an agent waits for the coordinator: at start, and after fencing its ranks for a
    coordinator back at the endpoint (0 there: end at once). Node 0's host waits as long for
    every other node's agent to check in."""
    token: str | None = None
    """The job token, the same on every node (None on one node: a fresh random one)."""
    domain: str = ""
    """This node's failure domain (``--domain``): the ranks refuse a layout in which one domain
    holds every replica of a stage, as they do for one node."""
    status_port: int | None = None
    """Serve the job's status page on this port (node 0; 0: any free port; None: no page)."""
    status_host: str = "127.0.0.1"
    """The address the status page binds to (loopback unless told otherwise)."""
    membership: bool = True
    """Tell the ranks where the coordinator is (``DS_RECYCLE_STORE``, token, incarnation). Without
    it the ranks see a plain launcher (DeepSpeed's environment only): for scripts that start
    torch.distributed themselves and need no membership, such as stock-against-ReCycle comparisons."""
    respawn: bool = False
    respawn_delay: float = 1.0
    timeout: float | None = None
    """Wall-clock bound on the whole job in seconds (None: no bound)."""
    log_dir: Path | None = None
    """``rank<R>.log`` per rank (truncated at launch, appended across incarnations); None: inherit stdout."""
    events: Path | None = None
    """Write the job's events here as JSON lines (:data:`EVENTS`; truncated at launch); None: none."""
    host: str = "127.0.0.1"
    env: dict[str, str] | None = None
    """Extra environment for the ranks (over os.environ)."""
    python: str = sys.executable
    backend: str = "gloo"
    """The ranks' communication backend (``--backend``): ``gloo`` (CPU) or ``nccl`` (each rank on a
    CUDA device; ranks beyond the host's GPUs share them)."""
    preload: tuple[str, ...] = ()
    """Modules to import once in a :class:`~ds_recycle.runtime.node.preload.Preloader` that forks every
    rank (``--preload``); empty: each rank is its own ``python argv...`` (exec)."""
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the launcher stops ranks."""
    restart_grace: float = 60.0
    """After a rank asked for a restart, how long the others get to end before they are killed."""
    max_restarts: int | None = None
    """Respawns of a slot that keeps failing soon after its start (None: no cap). A slot past it is
    not started again and the job goes on without it."""
    stable_seconds: float = 60.0
    """A process that ran this long before it failed ends its slot's run of quick failures."""
    max_backoff: float = 60.0
    """The respawn delay doubles with each quick failure in a row, up to this many seconds."""
    rebalance: bool = True
    """``--rebalance migrate``: a slot given up is published as retired, so that a survivor of a
    stage with workers to spare may move into it (the ranks propose the move when the planner
    predicts it pays); ``off``: the grid stays as the failures left it."""

    def host_config(self, token: str, local_node: int | None, beats_dir: str | None = None) -> HostConfig:
        """The coordinator's host of this job: node 0's (``local_node=0``) or a standalone
        ``ds-recycle coordinator``'s (``local_node=None``). It listens at ``endpoint``, or on a free
        port of ``host`` when there is none, and waits ``coordinator_wait`` for the agents."""
        host, port = self.endpoint or (self.host, 0)
        return HostConfig(
            nnodes=self.nnodes,
            nproc=self.nproc,
            host=host,
            port=port,
            token=token,
            node_lease=self.node_lease,
            heartbeat=self.heartbeat,
            status_port=self.status_port,
            status_host=self.status_host,
            local_node=local_node,
            check_in_timeout=self.coordinator_wait,
            beats_dir=beats_dir,
        )


@dataclass
class _Slot:
    slot: int
    local_rank: int
    """The device it runs on; a migration gives a retired slot the device of the mover."""
    proc: subprocess.Popen | PreloadedProcess | None = None
    incarnation: int = 0
    returncode: int | None = None
    """The last ended process's code (Popen convention); None while none has ended."""
    respawn_at: float | None = None
    """monotonic time at which a respawn is due."""
    killed_at_timeout: bool = False
    started_at: float = 0.0
    """monotonic time of the current process's start."""
    quick_failures: list[str] = field(default_factory=list)
    """How each failure in a row ended, of processes that failed within ``stable_seconds``."""
    given_up: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Launcher:
    """One job: ``Launcher(config).run()`` returns the launcher's exit code."""

    def __init__(self, config: LaunchConfig, echo: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._echo = echo or _print
        self._echo_lock = threading.Lock()
        self.events = EventStream(config.events)
        self._procs_lock = threading.Lock()  # reaping vs. the coordinator's kill
        first = config.node_rank * config.nproc
        self.slots = [_Slot(r, r - first) for r in range(first, first + config.nproc)]
        self._by_slot = {s.slot: s for s in self.slots}
        self.world_size = config.nnodes * config.nproc
        self.generation = 0
        self._gpus: int | None = None
        """The host's CUDA devices (asked once, with NCCL)."""
        self.token = config.token or secrets.token_hex(16)
        self.fenced: str | None = None
        """Why this node fenced itself (it could not renew its lease), or None."""
        self.finished = False
        self.stopped = False
        """A rank reported that training cannot go on (STOP_EXIT_CODE): no more respawns."""
        self.restart_requested = False
        self._signal: int | None = None
        self._others_deadline: float | None = None
        self._last_exit = 0.0
        """Wall time of the last exit waitpid saw."""
        self.host: CoordinatorHost | None = None
        self.succession: Succession | None = None
        """This agent's candidacy for the coordinator's role (etcd only)."""
        self._address: tuple[str, int] | None = None
        self.coordinator: Coordinator | NodeLink | None = None
        self.node_watch: NodeWatch | None = None
        """The node's store and its copy of the job's changes, for this generation's ranks."""
        self._preloader: Preloader | None = None
        self._preload_failed = False
        self.beats_dir = make_beat_directory(config.node_rank)
        """This node's ranks' heartbeat files, relayed by its lease (:mod:`ds_recycle.runtime.shared.beats`)."""

    # ---- public --------------------------------------------------------------------------------

    def run(self, handle_signals: bool = False) -> int:
        """Run the job to its end; ``handle_signals`` turns SIGINT/SIGTERM into a clean stop (main thread only)."""
        previous = self._install_signal_handlers() if handle_signals else {}
        self.events.open()
        code = None
        try:
            raise_descriptor_limit()  # for the store this agent may host, and for its ranks
            self._host_store()
            self._campaign()
            self._truncate_logs()
            try:
                self.generation = self.host.first_generation() if self.host else self._await_generation(-1)
                self._start_generation()
            except (NodeRefused, NodesMissing, CoordinatorGone) as refused:
                self.log(f"refused: {refused}" if isinstance(refused, NodeRefused) else str(refused))
                self.emit("node_refused", why=str(refused))
                code = FAILURE_EXIT_CODE
                return code
            code = self._loop()
            return code
        finally:
            self._kill_all()
            if self.coordinator is not None and not isinstance(self.coordinator, NodeLink):
                self.coordinator.stop()
            if self.node_watch is not None:
                self.node_watch.stop()
            if self.host is not None:
                self.host.stop()
            if self.succession is not None:
                self.succession.stop()
            if self._preloader is not None:
                self._preloader.close()
            shutil.rmtree(self.beats_dir, ignore_errors=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.events.close(code)
            if isinstance(self.coordinator, NodeLink):
                self.coordinator.end(code)  # last: the host waits for it, and may end the job then

    def results(self) -> list[RankResult]:
        return [
            RankResult(s.slot, None if s.killed_at_timeout else s.returncode, self._read_log(s.slot))
            for s in self.slots
        ]

    @property
    def address(self) -> tuple[str, int]:
        return self._address or self.config.endpoint

    @property
    def hosts_coordinator(self) -> bool:
        return self.config.node_rank == 0 and not self.config.external_coordinator and self.config.etcd is None

    @property
    def _endpoint_address(self) -> str:
        """Where the coordinator's store is expected: the endpoint (another node's agent, or a
        ``ds-recycle coordinator``, may not listen yet), or etcd's address."""
        if self.config.etcd is not None:
            return self.store_address
        host, port = self.config.endpoint
        return f"{host}:{port}"

    @property
    def store_address(self) -> str:
        """The job's store as its clients connect to it: ``host:port``, or an ``etcd://`` address."""
        if self.config.etcd is not None:
            from ds_recycle.runtime.shared.etcd_transport import job_name

            return transport.etcd_address(self.config.etcd, job_name(self.token))
        host, port = self.address
        return f"{host}:{port}"

    @property
    def coordinator_timeout(self) -> float:
        config = self.config
        return min(config.coordinator_timeout or DEFAULT_COORDINATOR_TIMEOUT, config.node_lease)

    # ---- setup ---------------------------------------------------------------------------------

    def _host_store(self) -> None:
        if not self.hosts_coordinator:
            return
        host_config = self.config.host_config(self.token, self.config.node_rank, self.beats_dir)
        self.host = CoordinatorHost(host_config, log=self.log, emit=self.emit, kill=self._kill_incarnation)
        self._address = self.host.listen()

    def _campaign(self) -> None:
        """On etcd: campaign for the coordinator's role beside the ranks, for as long as this agent runs."""
        if self.config.etcd is None:
            return
        host_config = self.config.host_config(self.token, None)
        self.succession = Succession(self.store_address, host_config, self.config.node_rank, self.log, self.emit)
        self.succession.start()

    def _start_generation(self) -> None:
        """Start every rank of this node in ``self.generation`` (its keys are written already when
        another node hosts the coordinator: :meth:`_await_generation` returned it)."""
        if self.host is not None:
            self.coordinator = self.host.start(self.generation, self.config.domain)
            first_incarnation = 0
        else:
            self.coordinator = self._link_to_coordinator(self.store_address, self.generation)
            first_incarnation = self.coordinator.node_incarnation - 1
            self.coordinator.start()  # a host's coordinator was started by host.start
        self._watch_changes()
        self.restart_requested = False
        for s in self.slots:
            s.incarnation, s.respawn_at = first_incarnation, None
            self._spawn(s)

    def _watch_changes(self) -> None:
        """This generation's node store, with the job's changes copied in for the ranks' watchers
        (:mod:`ds_recycle.runtime.node.node_watch`); the previous generation's is closed."""
        if self.node_watch is not None:
            self.node_watch.stop()
            self.node_watch = None
        if not self.config.membership:
            return
        slots = range(self.slots[0].slot, self.slots[-1].slot + 1)
        self.node_watch = NodeWatch(
            self.store_address, self.generation, self.config.node_rank, slots, self.token, self.log
        ).start()

    def _await_generation(self, last: int, newer_only: bool = True) -> int:
        """Check in at the coordinator's store and wait until it runs a generation after ``last``
        (``newer_only``) or any generation; raises CoordinatorGone. The bound is ``coordinator_wait``,
        at least START_WAIT_SECONDS at the job's start (the coordinator may start after the agents)."""
        config = self.config
        wait = config.coordinator_wait if last >= 0 else max(config.coordinator_wait, START_WAIT_SECONDS)
        return await_generation(self._endpoint_address, config.node_rank, self.token, last, wait, newer_only)

    def _link_to_coordinator(self, address: str, generation: int) -> NodeLink:
        """A node that does not host the coordinator: register a node incarnation in the generation
        (a restarted agent's ranks join the running job) and hold the node's lease."""
        link = NodeLink(
            address,
            generation,
            self.config.node_rank,
            self.token,
            self.config.node_lease,
            log=self.log,
            kill=self._kill_incarnation,
            fence=self._fence,
            grace=self.coordinator_timeout,
            beats_dir=self.beats_dir,
            slots=range(self.slots[0].slot, self.slots[-1].slot + 1),
        )
        incarnation = link.register(self.config.domain)
        what = "re-joins the running job" if link.rejoining else "starts"
        slots = [s.slot for s in self.slots]
        self.log(f"node {self.config.node_rank} (incarnation {incarnation}) {what}: slots {slots}")
        return link

    def _fence(self, why: str) -> None:
        """Called by the node's link when its lease lapsed: kill every rank of this node now."""
        self.fenced = why
        self.log(f"node {self.config.node_rank} fences itself: {why}; killing its ranks")
        self.emit("fenced", node=self.config.node_rank, why=why)
        with self._procs_lock:
            for s in self.slots:
                if s.running:
                    _killpg(s.proc.pid)

    def _rank_env(self) -> dict[str, str]:
        """The environment every rank of this node shares (before its own variables)."""
        env = {**os.environ, **(self.config.env or {})}
        env.setdefault("DS_ACCELERATOR", "cuda" if self.config.backend == "nccl" else "cpu")
        env[keys.ENV_BACKEND] = self.config.backend
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank killed by SIGABRT or SIGSEGV logs every thread's stack
        env[keys.ENV_BEATS] = self.beats_dir
        env.pop("LOCAL_SIZE", None)  # would turn on DeepSpeed's shm all-reduce (66 MB a rank, leaked on SIGKILL)
        return env

    def _device_index(self, local_rank: int) -> int:
        """The rank's ``LOCAL_RANK``: its local rank, or, with NCCL on a host of fewer GPUs than
        ranks (tests on one GPU), the GPU it shares (local rank mod GPUs), since DeepSpeed places
        a rank's modules on ``cuda:LOCAL_RANK``."""
        if self.config.backend != "nccl":
            return local_rank
        if self._gpus is None:
            import torch

            self._gpus = torch.cuda.device_count()
        return local_rank % self._gpus if 0 < self._gpus < self.config.nproc else local_rank

    def _spawn(self, s: _Slot) -> None:
        config = self.config
        env = self._rank_env()
        env.update(
            {
                "RANK": str(s.slot),
                "LOCAL_RANK": str(self._device_index(s.local_rank)),
                "GROUP_RANK": str(config.node_rank),
                "NODE_RANK": str(config.node_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(config.nproc),
                "TORCHELASTIC_RESTART_COUNT": str(self.generation),
                **transport.QUIET_STORE_ENV,
            }
        )
        if config.etcd is None:  # torchrun's agent store (etcd has no TCPStore to point at)
            host, port = self.address
            env.update({"MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
        if config.membership:
            env.update(
                {
                    keys.ENV_STORE: self.store_address,
                    keys.ENV_TOKEN: self.token,
                    keys.ENV_INCARNATION: str(s.incarnation),
                    keys.ENV_GENERATION: str(self.generation),
                    keys.ENV_NODE_STORE: self.node_watch.address,
                }
            )
            if self.generation > 0:
                env[keys.ENV_RESUME] = "required"
        started = time.time()
        log = None if config.log_dir is None else Path(config.log_dir) / f"rank{s.slot}.log"
        proc = self._fork_preloaded(env, log) if config.preload and not self._preload_failed else None
        if proc is None:
            cmd = [config.python, *config.argv]
            options = {"env": env, "start_new_session": True, "preexec_fn": die_with_parent}
            if log is None:
                proc = subprocess.Popen(cmd, **options)
            else:
                with open(log, "a") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **options)
        with self._procs_lock:
            s.proc = proc
            s.started_at = time.monotonic()
        self.coordinator.rank_started(s.slot, s.incarnation, started)
        self.log(f"rank {s.slot} pid {proc.pid} started")
        who = {"slot": s.slot, "pid": proc.pid, "incarnation": s.incarnation, "generation": self.generation}
        self.emit("started", **who)
        if s.incarnation > 0:
            self.log(f"rank {s.slot} respawned (incarnation {s.incarnation}, generation {self.generation})")
            self.emit("respawned", **who)

    def _fork_preloaded(self, env: dict[str, str], log: Path | None) -> PreloadedProcess | None:
        """The rank forked from the preloader (started on first use); None (exec instead, with a
        log line) when the preloader cannot start or fork."""
        try:
            if self._preloader is None:
                check_argv(self.config.argv)
                began = time.monotonic()
                self._preloader = Preloader(self.config.python, self.config.preload, self._rank_env())
                self.log(
                    f"preloaded {', '.join(self.config.preload)} in {time.monotonic() - began:.1f} s: "
                    "ranks are forked from it"
                )
            return self._preloader.spawn(self.config.argv, env, log, os.getcwd())
        except PreloadError as error:
            self.log(f"{error}: starting ranks with exec from now on")
            self._preload_failed = True
            return None

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> int:
        config = self.config
        deadline = None if config.timeout is None else time.monotonic() + config.timeout
        restart_deadline: float | None = None
        next_straggler_check = 0.0
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                self.log(f"timeout after {config.timeout:g} s: killing every rank")
                self.emit("timeout", seconds=config.timeout)
                for s in self.slots:
                    s.killed_at_timeout = s.running
                self._kill_all()
                return TIMEOUT_EXIT_CODE
            if self._signal is not None:
                return self._stop_on_signal()
            if self.fenced is not None:
                self._kill_all()
                code = self._after_fence()
                if code is not None:
                    return code
                continue
            for s in self.slots:
                self._reap(s)
            if self.finished:
                for s in self.slots:
                    s.respawn_at = None
            now = time.monotonic()
            for s in self.slots:
                if s.respawn_at is not None and now >= s.respawn_at and not self.finished:
                    s.respawn_at = None
                    s.incarnation += 1
                    self._spawn(s)
            running = [s for s in self.slots if s.running]
            if self.restart_requested:
                if restart_deadline is None:
                    restart_deadline = now + config.restart_grace
                    self._end_joiners(running)
                if running and now >= restart_deadline:
                    self.log(f"ranks still running {config.restart_grace:g} s after the restart request: killing them")
                    self._kill_all()
                    continue
                if not running:
                    restart_deadline = None
                    if not config.respawn:
                        self.log("a rank asked for a restart from the checkpoint; without --respawn the job ends")
                        return keys.RESTART_EXIT_CODE
                    self.coordinator.stop()
                    if self.host is not None:
                        self.generation += 1
                    else:
                        try:
                            self.generation = self._await_generation(self.generation, newer_only=True)
                        except CoordinatorGone as gone:
                            self.log(f"no new generation to restart in: {gone}")
                            return FAILURE_EXIT_CODE
                    self.log(f"restarting every rank from the checkpoint (generation {self.generation})")
                    self.emit("restarting", generation=self.generation)
                    self._start_generation()
                    continue
            elif not running and not any(s.respawn_at is not None for s in self.slots):
                if (self.hosts_coordinator and not self._other_nodes_ended(now)) or self._coordinator_in_doubt():
                    time.sleep(POLL_SECONDS)
                    continue
                return self._final_code()
            elif self.finished and running and now >= next_straggler_check:
                next_straggler_check = now + 0.2
                self._end_stragglers(running)
            time.sleep(POLL_SECONDS)

    def _reap(self, s: _Slot, respawn: bool = True) -> None:
        """If the slot's process ended: log it, tell the coordinator, apply the exit rules."""
        with self._procs_lock:
            if s.proc is None or s.proc.returncode is not None:
                return
            code = s.proc.poll()
            if code is None:
                return
            observed = self._last_exit = time.time()
            _killpg(s.proc.pid)  # the rank's leftover children, if any
        s.returncode = code
        self.log(f"rank {s.slot} exited ({describe_returncode(code)})")
        self.emit(
            "exited",
            slot=s.slot,
            pid=s.proc.pid,
            incarnation=s.incarnation,
            code=code if code >= 0 else None,
            signal=None if code >= 0 else describe_returncode(code).removeprefix("signal "),
        )
        self.coordinator.rank_exited(RankExit(s.slot, s.incarnation, code, observed))
        if code == keys.RESTART_EXIT_CODE:
            if not self.restart_requested:
                self.log(f"rank {s.slot} asked for a restart of the job from its checkpoint")
                self.emit("restart_requested", slot=s.slot)
            self.restart_requested = True
            return
        if code == keys.STOP_EXIT_CODE:
            if not self.stopped:
                self.log(f"rank {s.slot} stopped the job: training cannot go on in place (its log says why)")
                self.emit("stopped", slot=s.slot)
            self.stopped = self.finished = True
            return
        if self.restart_requested or not respawn:
            return
        target = self.coordinator.moved_to(s.slot) if self.hosts_coordinator and self.config.rebalance else None
        if target is not None and not self.finished:
            self._start_moved(s, self._by_slot[target])
            return
        if code == 0 and not self.finished and s.slot in self._membership().members:
            self.finished = True
            self.log(f"rank {s.slot} completed training: the job is finished, no more respawns")
            self.emit("completed", slot=s.slot)
        if self.config.respawn and not self.finished:
            self._schedule_respawn(s, code)

    def _start_moved(self, mover: _Slot, target: _Slot) -> None:
        """A mover left its slot by a decided move: its device serves ``target`` from now on (a
        joiner, started at once), and its own slot is retired in turn."""
        mover.given_up, mover.respawn_at = True, None
        target.local_rank, mover.local_rank = mover.local_rank, target.local_rank
        target.given_up, target.quick_failures = False, []
        target.respawn_at = time.monotonic()
        self.log(f"rank {mover.slot} moved: rank {target.slot} starts on its device (local rank {target.local_rank})")
        self.emit("moved", slot=mover.slot, target=target.slot, local_rank=target.local_rank)
        self.coordinator.retire(mover.slot, f"its device moved to slot {target.slot}")

    def _schedule_respawn(self, s: _Slot, code: int) -> None:
        """Respawn after ``respawn_delay``; a slot that fails again soon after its start waits
        twice as long each time (up to ``max_backoff``) and, past ``max_restarts``, is given up."""
        config = self.config
        lived = time.monotonic() - s.started_at
        if code in (0, keys.JOIN_GIVEN_UP_EXIT_CODE) or lived >= config.stable_seconds:
            s.quick_failures = []
        else:
            s.quick_failures.append(describe_returncode(code))
        failures = len(s.quick_failures)
        if config.max_restarts is not None and failures > config.max_restarts:
            s.given_up = True
            self.emit("given_up", slot=s.slot, failures=failures)
            self.log(
                f"rank {s.slot} failed {failures} times in a row, each within {config.stable_seconds:g} s of its start "
                f"({', '.join(s.quick_failures)}): not respawning it again (--max-restarts {config.max_restarts}); "
                "the job goes on without it"
            )
            if config.rebalance and self.hosts_coordinator:
                self.coordinator.retire(s.slot, f"given up after {failures} quick failures")
            return
        delay = config.respawn_delay * 2 ** max(0, failures - 1)
        delay = min(delay, max(config.max_backoff, config.respawn_delay))
        if failures >= 2:
            self.log(
                f"rank {s.slot} failed again {lived:.1f} s after its start ({failures} failures in a row: "
                f"{', '.join(s.quick_failures)}); respawning it in {delay:g} s"
            )
        s.respawn_at = time.monotonic() + delay

    def _other_nodes_ended(self, now: float) -> bool:
        """Node 0 hosts the store: it stays until every other node's ranks and agent have ended
        (their agents report it), so that none of them loses the store while it finishes, and a
        scheduler that ends the job with node 0's agent ends none of them early (bounded)."""
        if self.config.nnodes == 1:
            return True
        if self._others_deadline is None:
            self._others_deadline = now + OTHER_NODES_GRACE_SECONDS
        if now >= self._others_deadline:
            return True
        return self.coordinator.all_ended() and not self.host.agents_running()

    def _coordinator_in_doubt(self) -> bool:
        """Every rank of this node ended and the coordinator was not heard from since: they may
        have ended because its host died. The link tells within its grace (it renews or fences)."""
        link = self.coordinator
        return (
            isinstance(link, NodeLink)
            and not self.finished
            and not link.fenced
            and link.last_renewal <= self._last_exit
        )

    def _after_fence(self) -> int | None:
        """This node fenced itself (its ranks are dead). Wait, bounded, for a coordinator at the
        endpoint: one that runs a later generation (restarted after its host died) gets every rank
        again, from the latest checkpoint (returns None); the same one (this node was cut off or
        frozen, the job went on without it) or none ends the agent (returns the exit code)."""
        config, node = self.config, self.config.node_rank
        why, self.fenced = self.fenced, None
        self.coordinator.stop(timeout=1.0)
        if config.coordinator_wait <= 0:
            self.log(f"node {node} ended: fenced ({why})")
            return FAILURE_EXIT_CODE
        where = self._endpoint_address
        self.log(
            f"node {node} fenced its ranks ({why}); waiting up to {config.coordinator_wait:g} s for a coordinator "
            f"at {where} (--coordinator-wait) to restart the job from its latest checkpoint"
        )
        self.emit("coordinator_lost", node=node, generation=self.generation, wait=config.coordinator_wait)
        try:
            # On etcd the store outlives any host: a generation that still runs went on without this
            # node, or restarts once every node has fenced (a lost quorum): wait for a newer one.
            generation = self._await_generation(self.generation, newer_only=config.etcd is not None)
        except CoordinatorGone as gone:
            self.log(f"node {node} ended: fenced ({why}); {gone}")
            return FAILURE_EXIT_CODE
        if generation <= self.generation:
            self.log(
                f"node {node} ended: fenced ({why}); the coordinator at {where} still runs generation "
                f"{generation}, so the job went on without this node (it was cut off or frozen): start its agent "
                "again to re-admit it"
            )
            return FAILURE_EXIT_CODE
        self.log(
            f"a coordinator is back at {where}: every rank of node {node} starts again in generation "
            f"{generation}, from the latest checkpoint"
        )
        self.emit("restarting", generation=generation)
        self.generation = generation
        self.finished = self.stopped = False
        for s in self.slots:
            s.quick_failures, s.given_up = [], False
        self._start_generation()
        return None

    def _end_joiners(self, running: list[_Slot]) -> None:
        """At a restart request: a running rank that is not a member (its join is pending) holds
        nothing the restart needs and would wait for a boundary that never comes: kill it now
        rather than after ``restart_grace``."""
        members = self._membership().members
        joiners = [s for s in running if s.slot not in members]
        if joiners:
            self.log(f"ending ranks {[s.slot for s in joiners]}: joining, not members, before the restart")
            with self._procs_lock:
                for s in joiners:
                    if s.running:
                        _killpg(s.proc.pid)

    def _end_stragglers(self, running: list[_Slot]) -> None:
        """Once finished, a process that is not a member (a joiner nobody will admit) is stopped."""
        members = self._membership().members
        if any(s.slot in members for s in running):
            return
        self.log("the job is finished and no member is running: stopping the remaining processes")
        self._terminate(running)

    def _final_code(self) -> int:
        if self.stopped:
            self.log(
                "job stopped before it finished: a stage lost every worker, or a restart found no checkpoint "
                "(the ranks' logs say which)"
            )
            return FAILURE_EXIT_CODE
        members = self._membership().members
        bad = [s.slot for s in self.slots if s.slot in members and s.returncode != 0]
        if self.finished and not bad:
            self.log("job finished: every member exited 0")
            return 0
        if not self.finished:
            self.log("job ended without finishing: no member completed training")
        else:
            self.log(f"job finished, but members {bad} did not exit 0")
        return FAILURE_EXIT_CODE

    # ---- stopping ------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict:
        def on_signal(signum, frame):
            self._signal = signum

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _stop_on_signal(self) -> int:
        name = signal.Signals(self._signal).name
        self.log(f"got {name}: sending SIGTERM to every rank, SIGKILL after {self.config.grace:g} s")
        self.emit("interrupted", signal=name)
        self.finished = True  # no respawns
        self._terminate([s for s in self.slots if s.running])
        return 128 + self._signal

    def _terminate(self, slots: list[_Slot]) -> None:
        """SIGTERM to each rank's process group, then SIGKILL after the grace period (bounded)."""
        with self._procs_lock:
            for s in slots:
                if s.running:
                    _killpg(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace
        while time.monotonic() < deadline and any(s.running for s in slots):
            for s in slots:
                self._reap(s, respawn=False)
            time.sleep(0.01)
        self._kill_all()

    def _kill_all(self) -> None:
        """SIGKILL every rank still running (its whole process group), and reap it."""
        with self._procs_lock:
            alive = [s for s in self.slots if s.running]
            for s in alive:
                _killpg(s.proc.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(s.running for s in alive):
            for s in alive:
                self._reap(s, respawn=False)
            time.sleep(0.005)

    def _kill_incarnation(self, slot: int, incarnation: int) -> None:
        """The coordinator's callback for a hung member: SIGKILL it if it is still that incarnation."""
        s = self._by_slot.get(slot)
        if s is None:
            return
        with self._procs_lock:
            if s.incarnation == incarnation and s.running:
                _killpg(s.proc.pid)

    # ---- helpers -------------------------------------------------------------------------------

    def _membership(self) -> Membership:
        return self.coordinator.membership()

    def log(self, message: str) -> None:
        with self._echo_lock:
            self._echo(f"{LOG_PREFIX} {message}")

    def emit(self, event: str, **fields: object) -> None:
        self.events.emit(event, **fields)

    def _truncate_logs(self) -> None:
        if self.config.log_dir is None:
            return
        for s in self.slots:
            (Path(self.config.log_dir) / f"rank{s.slot}.log").write_text("")

    def _read_log(self, slot: int) -> str:
        if self.config.log_dir is None:
            return ""
        path = Path(self.config.log_dir) / f"rank{slot}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def launch(
    argv: list[str],
    world_size: int,
    timeout: float,
    log_dir: str | Path,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    *,
    respawn: bool = False,
    respawn_delay: float = 1.0,
    heartbeat: HeartbeatPolicy | None = None,
    echo: Callable[[str], None] | None = None,
    membership: bool = True,
    events: Path | None = None,
    preload: tuple[str, ...] = (),
    max_restarts: int | None = None,
    rebalance: bool = True,
    backend: str = "gloo",
) -> list[RankResult]:
    """Run ``python argv...`` as ranks 0..world_size-1 under a :class:`Launcher`.

    Returns one result per rank (its last process). Ranks still running after ``timeout`` seconds
    are killed and reported with ``returncode=None``. Events go to ``echo`` (default: nowhere).
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        argv=list(argv),
        nproc=world_size,
        respawn=respawn,
        respawn_delay=respawn_delay,
        timeout=timeout,
        log_dir=log_dir,
        env=env,
        python=python,
        heartbeat=heartbeat or HeartbeatPolicy(),
        membership=membership,
        events=events,
        preload=preload,
        max_restarts=max_restarts,
        rebalance=rebalance,
        backend=backend,
    )
    launcher = Launcher(config, echo=echo or (lambda line: None))
    launcher.run()
    return launcher.results()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _print(line: str) -> None:
    print(line, flush=True)


def _killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
