"""The coordinator's host: the job's store, the generation it runs, its :class:`Coordinator` and
status page.

By default node 0's agent (``ds-recycle launch``) is the host, as torchrun's c10d host; with
``ds-recycle coordinator`` a host of its own runs it and every node's agent, node 0's included,
joins it through a :class:`~ds_recycle.runtime.node.link.NodeLink`. Either way one
:class:`CoordinatorHost`:

- listens: a TCPStore at the endpoint (:meth:`CoordinatorHost.listen`);
- chooses the generation (:meth:`CoordinatorHost.first_generation`): it waits until every node's
  agent has checked in (``check_in/<node>``, with the generation its ranks ran last) and runs
  max(last) + 1, 0 for a fresh job. A host started again after its predecessor died has a fresh
  store; the agents that waited for it carry the generation, and the ranks of the new one resume
  from the latest checkpoint. A number above every earlier one also keeps any process of an
  earlier generation from writing into the new one (every key is under ``job/<generation>/``);
- writes ``world_size``, ``epoch/0``, ``pending`` and ``current_epoch`` under ``job/<g>/``, then
  the root key ``generation`` that the agents wait for, and starts the generation's coordinator
  and status page (:meth:`CoordinatorHost.start`);
- says when the job is over on every node (:meth:`CoordinatorHost.nodes_ended`), and which nodes'
  agents still run (:meth:`CoordinatorHost.agents_running`).

:func:`serve` is the whole of ``ds-recycle coordinator``: it hosts the job until every node's agent
ended (or died), starting a new generation when the ranks asked for a restart from the checkpoint.
"""

from __future__ import annotations

import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ds_recycle.runtime.control.coordinator import Coordinator, HeartbeatPolicy, NodeLayout
from ds_recycle.runtime.control.status import StatusServer
from ds_recycle.runtime.shared import keys, transport
from ds_recycle.runtime.shared.c10d_store import C10dJobStore, C10dStoreRoot
from ds_recycle.runtime.shared.job_store import JobStore, StoreRoot
from ds_recycle.runtime.shared.records import AgentEnd, CheckIn, Lease
from ds_recycle.runtime.shared.seal import ForgedRecord

CHECK_IN_POLL_SECONDS = 0.05
TIMEOUT_EXIT_CODE = 124
FENCE_CHECK_SECONDS = 1.0
"""How often the coordinator looks whether every node's agent fenced its ranks (see every_node_fenced)."""
FENCED_CHECK_IN_SECONDS_PER_LEASE = 2.0
"""How long, in node leases, the coordinator waits before it ends the job for nodes whose leases
lapsed: long enough for agents that fenced themselves to check in again (see :func:`coordinate`)."""
ROLE_LOST_EXIT_CODE = 3
"""The coordinator's role passed to another agent (etcd) while this one held it."""
FAILURE_EXIT_CODE = 1
LOG_PREFIX = "[ds-recycle coordinator]"


STORE_CLIENTS_PER_RANK = 2
"""A rank's own connections to the store: its agent's and its failure watcher's..."""
STORE_CLIENTS_PER_RANK_AND_EPOCH = 1
"""...and one per epoch it went through: each world's own client (``groups.rebuild_world``), kept
with the world's groups for the life of the rank."""
STORE_CLIENTS_PER_NODE = 3
"""A node's agent: its link's two clients, and one while it waits for a generation."""
STORE_OWN_DESCRIPTORS = 64
"""The store process's own descriptors beside its clients' connections (its listener, logs, libraries)."""
MIN_EPOCHS = 64
"""The store's host warns when its descriptor limit allows fewer epochs (failures, leaves, joins)."""


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open descriptors to its hard limit (the ranks it starts
    inherit it); returns (soft, hard) as they are now. A store at thousands of ranks, or a rank
    that went through many epochs, needs more than the common soft default of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def descriptor_shortfall(config: HostConfig, limit: int) -> str | None:
    """Why ``limit`` descriptors may not serve the store of ``config``'s job for MIN_EPOCHS
    epochs; None if they should."""
    if limit == resource.RLIM_INFINITY:
        return None
    fixed = config.world_size * STORE_CLIENTS_PER_RANK + config.nnodes * STORE_CLIENTS_PER_NODE + STORE_OWN_DESCRIPTORS
    epochs = (limit - fixed) // (config.world_size * STORE_CLIENTS_PER_RANK_AND_EPOCH)
    if epochs >= MIN_EPOCHS:
        return None
    return (
        f"this process may open {limit} descriptors (ulimit -Hn), and the store takes {STORE_CLIENTS_PER_RANK} "
        f"connections per rank plus {STORE_CLIENTS_PER_RANK_AND_EPOCH} per rank and epoch ({config.world_size} "
        f"ranks, {config.nnodes} node agents x {STORE_CLIENTS_PER_NODE}): {max(epochs, 0)} epochs (failures, "
        f"leaves, joins) before ranks fail to connect; raise the hard limit to at least "
        f"{fixed + MIN_EPOCHS * config.world_size * STORE_CLIENTS_PER_RANK_AND_EPOCH}"
    )


class NodesMissing(RuntimeError):
    """Some node's agent did not check in within the bound: the job cannot start a generation."""


@dataclass(frozen=True)
class HostConfig:
    """What the coordinator's host needs; the same from ``ds-recycle launch`` and ``ds-recycle coordinator``."""

    nnodes: int
    nproc: int
    """Ranks per node."""
    host: str
    port: int
    """0: any free port (one node)."""
    token: str
    node_lease: float = 5.0
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    status_port: int | None = None
    status_host: str = "127.0.0.1"
    """The status page's address (loopback unless told otherwise), whatever the store's."""
    local_node: int | None = 0
    """The node whose agent runs this host (its ranks are killed here, not by kill orders); None
    for a standalone ``ds-recycle coordinator``."""
    check_in_timeout: float = 600.0
    """How long :meth:`CoordinatorHost.first_generation` waits for every node's agent."""
    beats_dir: str | None = None
    """Where ``local_node``'s ranks write their beats (:mod:`ds_recycle.runtime.shared.beats`)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


class CoordinatorHost:
    """The store and the coordinator of one job, one generation after the other."""

    def __init__(
        self,
        config: HostConfig,
        log: Callable[[str], None],
        emit: Callable[..., None],
        kill: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self._log, self._emit = log, emit
        self._kill = kill or _no_local_ranks
        self._server = None
        self._fence_checked = 0.0
        self._address = ""
        self._root: StoreRoot | None = None
        self._store: JobStore | None = None
        """A client under the running generation's prefix."""
        self.coordinator: Coordinator | None = None
        self.status: StatusServer | None = None
        self.generation: int | None = None

    # ---- the store -------------------------------------------------------------------------------

    def listen(self) -> tuple[str, int]:
        config = self.config
        # The entry point raised the soft limit to the hard one (raise_descriptor_limit): the hard one counts.
        _, limit = resource.getrlimit(resource.RLIMIT_NOFILE)
        shortfall = descriptor_shortfall(config, limit)
        if shortfall is not None:
            self._log(f"warning: {shortfall}")
        self._server = transport.serve(config.host, config.port, timeout=30.0)
        self._address = f"{config.host}:{self._server.port}"
        self._root = C10dStoreRoot.connect(self.address, config.token, timeout=30.0)
        self._log(f"store listening on {config.host}:{self._server.port}")
        self._emit("store", host=config.host, port=self._server.port)
        return config.host, self._server.port

    @property
    def address(self) -> str:
        return self._address

    # ---- the generation --------------------------------------------------------------------------

    def first_generation(self, local_last: int = -1) -> int:
        """Wait until every other node's agent has checked in (bounded by ``check_in_timeout``);
        the generation to run is the highest one any of them ran, plus one (0 for a fresh job)."""
        config = self.config
        remote = [k for k in range(config.nnodes) if k != config.local_node]
        lasts = {config.local_node: local_last} if config.local_node is not None else {}
        deadline = time.monotonic() + config.check_in_timeout
        logged = False
        while True:
            for node in remote:
                if node not in lasts:
                    check_in = self._read_check_in(node)
                    if check_in is not None:
                        lasts[node] = check_in.last_generation
            missing = [k for k in remote if k not in lasts]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise NodesMissing(
                    f"nodes {missing} did not check in within {config.check_in_timeout:g} s: is an agent "
                    f"(ds-recycle launch --node-rank K) running for each, with this job's token and endpoint?"
                )
            if not logged and remote:
                logged = True
                self._log(f"waiting up to {config.check_in_timeout:g} s for the agents of nodes {missing}")
            time.sleep(CHECK_IN_POLL_SECONDS)
        generation = max(lasts.values(), default=-1) + 1
        if generation > 0:
            ran = {k: g for k, g in sorted(lasts.items()) if g >= 0}
            self._log(
                f"the agents ran generations {ran} before: this coordinator runs generation {generation}, "
                "whose ranks resume from the latest checkpoint"
            )
        return generation

    def _read_check_in(self, node: int) -> CheckIn | None:
        try:
            check_in = self._root.check_in_of(node)
        except ForgedRecord:
            check_in = None
        else:
            if check_in is None:
                return None
            if check_in.node == node:
                return check_in
        self._log(f"refused the check-in of node {node}: not sealed with the job token (a process without it)")
        self._emit("refused_check_in", node=node)
        self._root.withdraw_check_in(node)
        return None

    def attach(self, address: str) -> None:
        """Coordinate the job on a store that runs elsewhere (etcd: :mod:`ds_recycle.runtime.control.succession`)
        instead of hosting one."""
        self._address = address
        self._root = C10dStoreRoot.connect(address, self.config.token, timeout=30.0)

    def running_generation(self) -> int | None:
        """The generation a coordinator runs on the store (one that ran before this one, on etcd)."""
        return self._root.running_generation()

    def start(self, generation: int, local_domain: str = "", resume: bool = False) -> Coordinator:
        """Write generation ``generation``'s keys, then ``generation``, and start its coordinator;
        ``resume``: the generation runs already (its coordinator's host died): take it over."""
        config = self.config
        if self.coordinator is not None:
            self.coordinator.stop()
        n = config.world_size
        store = C10dJobStore.connect(self.address, generation, config.token, timeout=30.0)
        if not resume:
            store.open_job(n, config.nnodes)
            if config.local_node is not None:
                store.set_domain(config.local_node, local_domain)
            self._root.start_generation(generation)
        self.generation, self._store = generation, store
        self.coordinator = Coordinator(
            self.address,
            generation,
            n,
            config.token,
            log=self._log,
            kill=self._kill,
            policy=config.heartbeat,
            nodes=NodeLayout(config.nnodes, config.nproc, config.node_lease),
            events=self._emit,
            local_node=config.local_node,
            beats_dir=config.beats_dir,
        )
        self.coordinator.start(resume)
        self._serve_status(generation)
        return self.coordinator

    def _serve_status(self, generation: int) -> None:
        config = self.config
        if config.status_port is None:
            return
        if self.status is not None:
            self.status.stop()
        self.status = StatusServer(self.address, generation, config.token, config.status_host, config.status_port)
        self.status.start()
        self._log(f"status page at {self.status.url} (JSON: {self.status.url}status.json)")

    # ---- the end ---------------------------------------------------------------------------------

    def every_node_fenced(self) -> bool:
        """Every node's agent checked in again after running this generation: each fenced its ranks
        (on etcd, after losing the quorum for longer than the lease) and waits for the next one.
        Looked at every FENCE_CHECK_SECONDS, and only up to the first node still running."""
        now = time.monotonic()
        if now - self._fence_checked < FENCE_CHECK_SECONDS:
            return False
        self._fence_checked = now
        for node in range(self.config.nnodes):
            try:
                check_in = self._root.check_in_of(node)
            except ForgedRecord:
                return False
            if check_in is None or check_in.last_generation < self.generation:
                return False
        return True

    def restart_requested(self) -> bool:
        """A rank of this generation asked for a restart of the job from its checkpoint."""
        codes = self.coordinator.exit_codes if self.coordinator is not None else {}
        return keys.RESTART_EXIT_CODE in codes.values()

    def nodes_ended(self) -> dict[int, int | None] | None:
        """Once every remote node's latest agent has ended: its exit code (None for one that died:
        its lease lapsed without an end written). None while one is still running, or before any
        has renewed a lease in this generation."""
        ended: dict[int, int | None] = {}
        now = time.time()
        for node, (lease, end) in self._remote_agents().items():
            if end is not None:
                ended[node] = end.code
            elif lease is None or now - lease.time <= self.config.node_lease:
                return None
            else:
                ended[node] = None
        return ended or None

    def agents_running(self) -> list[int]:
        """The remote nodes whose latest agent holds a live lease and has not ended: node 0's agent
        waits for them before it ends, so that the job's end (Slurm's, with its batch script's)
        does not cut short a re-admitted agent's own."""
        now = time.time()
        agents = self._remote_agents().items()
        return [
            node
            for node, (lease, end) in agents
            if end is None and lease is not None and now - lease.time <= self.config.node_lease
        ]

    def _remote_agents(self) -> dict[int, tuple[Lease | None, AgentEnd | None]]:
        """Each remote node's lease, and the end of its latest agent (an end written by an earlier
        incarnation than the lease's does not count: the node was re-admitted since)."""
        store = self._store
        agents: dict[int, tuple[Lease | None, AgentEnd | None]] = {}
        for node in range(self.config.nnodes):
            if node == self.config.local_node:
                continue
            lease, end = store.lease(node), store.node_end(node)
            if end is not None and lease is not None and end.node_incarnation < lease.node_incarnation:
                end = None
            agents[node] = (lease, end)
        return agents

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.status is not None:
            self.status.stop()


def serve(
    config: HostConfig,
    log: Callable[[str], None],
    emit: Callable[..., None],
    timeout: float | None = None,
    stop_signal: Callable[[], int | None] = lambda: None,
) -> int:
    """``ds-recycle coordinator``: host the job until every node's agent has ended; 0 iff every one
    ended 0, 124 at ``timeout``, 128 + signal when ``stop_signal()`` names one, else 1."""
    raise_descriptor_limit()
    host = CoordinatorHost(config, log, emit)
    try:
        host.listen()
        return coordinate(host, log, emit, timeout, stop_signal)
    finally:
        host.stop()


def coordinate(
    host: CoordinatorHost,
    log: Callable[[str], None],
    emit: Callable[..., None],
    timeout: float | None = None,
    stop_signal: Callable[[], int | None] = lambda: None,
    still_held: Callable[[], bool] = lambda: True,
) -> int:
    """Coordinate the job on ``host``'s store until every node's agent has ended (:func:`serve`'s
    exit codes): the generation a predecessor ran if there is one (on etcd), else a first one.
    Returns ROLE_LOST_EXIT_CODE as soon as ``still_held()`` is false (the role passed to another)."""
    config = host.config
    deadline = None if timeout is None else time.monotonic() + timeout
    gone_since: float | None = None
    try:
        generation = host.running_generation()
        if generation is not None:
            host.start(generation, resume=True)
        else:
            generation = host.first_generation()
            host.start(generation)
            log(f"generation {generation} started: {config.nnodes} nodes x {config.nproc} ranks")
        while True:
            time.sleep(CHECK_IN_POLL_SECONDS)
            if not still_held():
                log(f"no longer holds the coordinator's role: generation {generation}'s coordinator stops here")
                return ROLE_LOST_EXIT_CODE
            received = stop_signal()
            if received is not None:
                log(f"got {signal.Signals(received).name}: the coordinator ends (the agents fence their ranks)")
                return 128 + received
            if deadline is not None and time.monotonic() >= deadline:
                log(f"timeout after {timeout:g} s: the coordinator ends")
                return TIMEOUT_EXIT_CODE
            if host.restart_requested() and host.coordinator.all_ended():
                why = ""
            elif host.every_node_fenced():
                why = (
                    "every node's agent fenced its ranks and waits for a new generation (the store was out of "
                    "reach of them all): "
                )
            else:
                why = None
            if why is not None:
                generation += 1
                log(f"{why}restarting every rank from the checkpoint (generation {generation})")
                emit("restarting", generation=generation)
                host.start(generation)
                gone_since = None
                continue
            ended = host.nodes_ended()
            if ended is None:
                gone_since = None
                continue
            died = sorted(node for node, code in ended.items() if code is None)
            failed = sorted(node for node, code in ended.items() if code not in (0, None))
            if not died and not failed:
                log("job finished: every node's agent exited 0")
                return 0
            if died:
                # A lease that lapsed may be a fence (etcd out of reach of every node): such an agent
                # checks in again as soon as the store answers, and every_node_fenced restarts the job.
                gone_since = time.monotonic() if gone_since is None else gone_since
                if time.monotonic() - gone_since < FENCED_CHECK_IN_SECONDS_PER_LEASE * config.node_lease:
                    continue
            log(f"job ended: nodes {failed} exited non-zero, nodes {died} are gone (their leases lapsed)")
            return FAILURE_EXIT_CODE
    except NodesMissing as missing:
        log(str(missing))
        return FAILURE_EXIT_CODE
    finally:
        if host.coordinator is not None:
            host.coordinator.stop()


def _no_local_ranks(slot: int, incarnation: int) -> None:
    raise AssertionError(f"a standalone coordinator has no local rank to kill (slot {slot})")
