"""Emulated ranks and node agents that speak the real control-plane protocol, to measure it at scale.

An emulated rank is a trainer's side of the protocol without torch's engine: the real
:class:`MembershipAgent` (its heartbeat thread, boundary decisions, recovery and the ready barrier)
and the real :class:`FailureWatcher`, driven by a loop that sleeps through each iteration instead
of computing. An emulated node is a real :class:`NodeLink` (lease, reports, kill orders) and a real
:class:`NodeWatch` (the node's store, with its copy of the job's changes). The
coordinator is the real :class:`Coordinator`, in the harness's process beside the job's store: a
TCPStore server (``store="c10d"``) or a 3-member etcd cluster on loopback (``store="etcd"``, its
clients :class:`~ds_recycle.runtime.shared.etcd_transport.EtcdStore`; the nodes' own stores stay
TCPStores, as in the runtime). Worker processes host the nodes; in them every store client that
``transport.connect`` opens (an etcd client too) is a :class:`CountingStore`, so the harness counts
exactly the operations the real code makes (those on the nodes' own stores apart, in
:data:`NODE_COUNTS`: they never reach the job's store).

Iteration boundaries fall on wall-clock multiples of the iteration time, the same for every rank, so
a boundary decision's latency is the time from the boundary to the last member holding it.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from ds_recycle.runtime.control.coordinator import Coordinator, HeartbeatPolicy, NodeLayout, RankExit
from ds_recycle.runtime.node.link import NodeLink
from ds_recycle.runtime.node.node_watch import NodeWatch
from ds_recycle.runtime.rank.membership import MembershipAgent
from ds_recycle.runtime.rank.waiting import FailureWatcher
from ds_recycle.runtime.shared import transport
from ds_recycle.runtime.shared.c10d_store import C10dJobStore
from ds_recycle.runtime.shared.records import Progress
from ds_recycle.testing import spawn_context
from ds_recycle.testing.etcd_cluster import EtcdCluster, etcd_binary

TOKEN = "scale-harness"
STORES = ("c10d", "etcd")
"""The job's store a harness runs on: a TCPStore server, or an etcd cluster of 3 members."""
THREAD_STACK_BYTES = 256 * 1024


class CountingStore:
    """A c10d store client that counts its operations and the bytes it reads (all instances of one
    process add into ``counts``: :data:`COUNTS` by default): a
    :class:`~ds_recycle.runtime.shared.c10d_store.C10dJobStore` speaks through it as through the client
    it wraps."""

    def __init__(self, store: transport.Store, counts: collections.Counter | None = None) -> None:
        self._store = store
        self._counts = COUNTS if counts is None else counts
        self.ops = 0
        self.bytes_read = 0

    def _count(self, op: str, read: int = 0) -> None:
        self.ops += 1
        self.bytes_read += read
        self._counts[op] += 1
        self._counts["bytes_read"] += read

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._count("get", len(value))
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        self._count("set")

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._count("add", 8)
        return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        value = self._store.compare_set(key, expected, desired)
        self._count("compare_set", len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        value = self._store.check(keys)
        self._count("check", 1)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        try:
            self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)
        finally:
            self._count("wait")

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self._store.multi_set(keys, values)
        self._count("multi_set")

    def delete_key(self, key: str) -> bool:
        value = self._store.delete_key(key)
        self._count("delete_key")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._store.multi_get(keys)
        self._count("multi_get", sum(len(v) for v in values))
        return values


COUNTS: collections.Counter = collections.Counter()
NODE_COUNTS: collections.Counter = collections.Counter()
"""The operations on the nodes' own stores (:mod:`ds_recycle.runtime.node.node_watch`)..."""
NODE_ADDRESSES: set[str] = set()
"""...at these addresses (each node's, registered before its first client connects)."""


def _counting_connect(connect):
    def counted(
        address: str,
        generation: int | None,
        timeout: float = transport.STORE_TIMEOUT_SECONDS,
        connect_timeout: float | None = None,
    ) -> CountingStore:
        counts = NODE_COUNTS if address in NODE_ADDRESSES else COUNTS
        return CountingStore(connect(address, generation, timeout, connect_timeout), counts)

    counted.counting = True
    return counted


@dataclass(frozen=True)
class Shape:
    """One emulated job: ``nodes`` x ``per_node`` ranks."""

    nodes: int
    per_node: int
    iteration_seconds: float
    lease_seconds: float

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass
class EmulatedRank:
    """One trainer: the real agent and watcher, an iteration loop that sleeps."""

    agent: MembershipAgent
    shape: Shape
    t0: float
    records: list
    """(kind, slot, epoch or iteration, since, at, bytes read) tuples, appended by the rank's thread;
    a boundary's and a recovery's also end with the store operations the rank made for it."""
    stop: threading.Event = field(default_factory=threading.Event)
    connected: threading.Event = field(default_factory=threading.Event)
    watcher: FailureWatcher | None = None
    watcher_ops: int = 0
    """The watcher's store operations at the rank's last record."""

    def start(self) -> None:
        """Start the rank and wait until its three store clients are connected (thousands of
        simultaneous connects overflow the server's listen backlog: SYN retries take seconds)."""
        threading.Thread(target=self._run, name=f"rank-{self.agent.slot}", daemon=True).start()
        if not self.connected.wait(60.0):
            raise TimeoutError(f"emulated slot {self.agent.slot} did not connect to the store within 60 s")

    def kill(self) -> None:
        """Like a SIGKILL: the rank's threads stop answering (its heartbeat stops too)."""
        self.stop.set()
        self.agent._stop.set()
        if self.watcher is not None:
            self.watcher._stop.set()

    def _next_boundary(self) -> float:
        t = self.shape.iteration_seconds
        return self.t0 + t * math.ceil((time.time() - self.t0) / t + 1e-9)

    def _run(self) -> None:
        agent = self.agent
        agent.store = agent.connect()
        agent.node_store = agent.connect_node()
        agent.current = agent.store.membership()
        agent.start_heartbeat()
        watcher = FailureWatcher(agent.connect_node(), agent.slot, agent.node_store, agent.note_changes)
        self.watcher = watcher.start()
        self.connected.set()
        done = agent.current.iteration
        while not self.stop.is_set():
            boundary = self._next_boundary()
            if self.watcher.flag.wait(max(0.0, boundary - time.time())):
                if self.stop.is_set():
                    return
                done = self._recover(done)
                if done < 0:
                    return
                continue
            if self.stop.is_set():
                return
            done += 1
            before, ops = agent.store.client.bytes_read, agent.store.client.ops
            agent.publish_iteration_seconds(self.shape.iteration_seconds)
            decision = agent.decide(done)
            read, made = agent.store.client.bytes_read - before, agent.store.client.ops - ops
            self.records.append(("boundary", agent.slot, done, boundary, time.time(), read, made))
            self.watcher_ops = self.watcher.store.client.ops
            if decision.next is not None:
                if agent.slot not in decision.next.members:
                    return
                agent.enter(decision.next, self.watcher.flag.is_set, 60.0)

    def _recover(self, done: int) -> int:
        agent, watcher = self.agent, self.watcher
        before, ops = agent.store.client.bytes_read, agent.store.client.ops
        members = agent.current.members
        decision = agent.recover(Progress(done, False), members, 30.0, 60.0)
        held, raised_at = time.time(), watcher.raised_at
        watcher.acknowledge(agent.applied)
        epoch = decision.next.epoch
        read, made = agent.store.client.bytes_read - before, agent.store.client.ops - ops
        watched, self.watcher_ops = watcher.store.client.ops - self.watcher_ops, watcher.store.client.ops
        self.records.append(("recovered", agent.slot, epoch, raised_at, held, read, made, watched))
        if agent.slot not in decision.next.members:
            return -1
        agent.enter(decision.next, watcher.flag.is_set, 60.0, copied=True)
        self.records.append(("entered", agent.slot, epoch, 0.0, time.time(), 0))
        return decision.iteration


def beats_dir(root: str, node: int) -> str:
    """Node ``node``'s beat directory under the harness's ``root`` (one machine plays every node)."""
    path = os.path.join(root, f"node{node}")
    os.makedirs(path, exist_ok=True)
    return path


def _worker(
    address: str, shape: Shape, nodes: list[int], t0: float, root: str, commands: mp.Queue, events: mp.Queue
) -> None:
    import torch.distributed  # noqa: F401  (before the threads: ``connect`` imports it lazily)

    threading.stack_size(THREAD_STACK_BYTES)
    # A process's first connect can take seconds here (a reverse lookup of the client socket's
    # address times out): take it before any client with a short timeout (a NodeLink's) connects.
    transport.connect(address, 0, timeout=60.0)
    count_store_operations()
    COUNTS.clear()  # forked: the parent's counts are not this process's
    NODE_COUNTS.clear()
    records: list[tuple] = []
    threading.excepthook = lambda args: records.append(
        ("error", args.thread.name, 0, 0.0, time.time(), f"{args.exc_type.__name__}: {args.exc_value}")
    )
    ranks: dict[int, EmulatedRank] = {}
    links: dict[int, NodeLink] = {}
    watches: dict[int, NodeWatch] = {}

    def shape_node(slot: int) -> int:
        return slot // shape.per_node

    def kill_rank(slot: int, incarnation: int) -> None:  # a kill order: the coordinator judged it hung
        if slot in ranks and not ranks[slot].stop.is_set():
            ranks[slot].kill()
            records.append(("hung", slot, 0, 0.0, time.time(), 0))
            links[shape_node(slot)].rank_exited(RankExit(slot, incarnation, -9, time.time()))

    def fence(why: str, slots: range) -> None:
        records.append(("fenced", slots[0] // shape.per_node, 0, 0.0, time.time(), 0))
        for slot in slots:
            if slot in ranks:
                ranks[slot].kill()

    for node in nodes:
        slots = range(node * shape.per_node, (node + 1) * shape.per_node)
        if node > 0:
            link = _retrying(
                lambda slots=slots, node=node: NodeLink(
                    address,
                    0,
                    node,
                    TOKEN,
                    shape.lease_seconds,
                    log=lambda line: None,
                    kill=kill_rank,
                    fence=lambda why, slots=slots: fence(why, slots),
                    beats_dir=beats_dir(root, node),
                    slots=slots,
                )
            )
            link.register()
            link.start()
            links[node] = link
        watches[node] = _retrying(lambda node=node, slots=slots: NodeWatch(address, 0, node, slots, TOKEN))
        NODE_ADDRESSES.add(watches[node].address)
        watches[node].start()
        for slot in slots:
            agent = MembershipAgent(
                address=address,
                slot=slot,
                token=TOKEN,
                incarnation=0,
                generation=0,
                beats_dir=beats_dir(root, node),
                node_address=watches[node].address,
                node_slots=tuple(watches[node].slots),
            )
            ranks[slot] = EmulatedRank(agent, shape, t0, records)
            ranks[slot].start()
            if node > 0:
                links[node].rank_started(slot, 0, time.time())
    events.put(("ready", os.getpid(), len(ranks), 0.0, time.time(), 0))
    while True:
        command, argument = commands.get()
        if command == "report":
            taken = records[:]
            del records[: len(taken)]
            counts = {**COUNTS, **{f"node {op}": n for op, n in NODE_COUNTS.items()}}
            events.put(("report", os.getpid(), counts, 0.0, time.time(), taken))
        elif command == "kill_rank":  # a process death seen by its node's waitpid
            killed = time.time()
            ranks[argument].kill()
            links[shape_node(argument)].rank_exited(RankExit(argument, 0, -9, killed))
            records.append(("killed", argument, 0, 0.0, killed, 0))
        elif command == "kill_node":  # the node and its agent are gone at once
            killed = time.time()
            links[argument].stop(timeout=0.0)
            links[argument]._stop.set()
            watches[argument]._stop.set()
            for slot in range(argument * shape.per_node, (argument + 1) * shape.per_node):
                ranks[slot].kill()
            records.append(("killed_node", argument, 0, 0.0, killed, 0))
        elif command == "exit":
            return


def _serve_store(host: str, ports: mp.Queue, use_libuv: bool = True) -> None:
    """The TCPStore server, in a process of its own (as on the coordinator's host)."""

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = transport.serve(host, 0, timeout=60.0, use_libuv=use_libuv)
    ports.put(server.port)
    threading.Event().wait()


def _hammer(address: str, clients: int, seconds: float, start, results: mp.Queue) -> None:
    """``clients`` threads, each with its own client, reading the ``alert`` count (one ``add(key,
    0)``) back to back for
    ``seconds`` once every client of every process is connected (``start``, a barrier: a connect
    here can take seconds)."""
    counts = [0] * clients
    connected = threading.Semaphore(0)
    go, stop = threading.Event(), threading.Event()

    def run(index: int) -> None:
        store = C10dJobStore.connect(address, 0, TOKEN, timeout=60.0)
        store.alert_count()
        connected.release()
        go.wait()
        while not stop.is_set():
            store.alert_count()
            counts[index] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for _ in range(clients):
        if not connected.acquire(timeout=300.0):
            raise TimeoutError("the hammer's clients did not connect within 300 s")
    start.wait(timeout=300.0)
    go.set()
    time.sleep(seconds)
    stop.set()
    results.put(sum(counts))
    for thread in threads:
        thread.join(timeout=5.0)


def store_capacity(use_libuv: bool, processes: int = 2, clients: int = 32, seconds: float = 3.0) -> float:
    """Store operations per second that one TCPStore server answers when ``processes`` x ``clients``
    connections send small operations back to back (its saturation point on this machine)."""
    ctx = spawn_context()
    ports: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_serve_store, args=("127.0.0.1", ports, use_libuv), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=120.0)}"
        results: mp.Queue = ctx.Queue()
        start = ctx.Barrier(processes)
        procs = [
            ctx.Process(target=_hammer, args=(address, clients, seconds, start, results)) for _ in range(processes)
        ]
        for proc in procs:
            proc.start()
        total = sum(results.get(timeout=600.0) for _ in procs)
        for proc in procs:
            proc.join(timeout=10.0)
        return total / seconds
    finally:
        server.kill()
        server.join()


def _retrying(make, tries: int = 10):
    """``make()``, retried on a connect that timed out, as the launcher retries its link (a connect
    here now and then takes seconds while the server is busy)."""
    from torch.distributed import DistNetworkError

    for attempt in range(tries):
        try:
            return make()
        except DistNetworkError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


@dataclass
class Harness:
    """The real coordinator in this process; the job's store (the TCPStore server, or with
    ``store="etcd"`` a 3-member etcd cluster, RuntimeError where etcd is missing) and the emulated
    nodes (in ``workers`` processes) in processes of their own."""

    shape: Shape
    workers: int
    store: str = "c10d"
    host: str = "127.0.0.1"
    log: list[str] = field(default_factory=list)
    errors: list[tuple] = field(default_factory=list)
    """The emulated threads' uncaught exceptions, from every report so far."""

    def __post_init__(self) -> None:
        if self.store not in STORES:
            raise ValueError(f"store {self.store!r}: expected one of {', '.join(STORES)}")
        self.server: mp.Process | None = None
        self.cluster: EtcdCluster | None = None
        self.coordinator: Coordinator | None = None
        self.procs: list[mp.Process] = []
        self.commands: list[mp.Queue] = []
        self.root: str | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        ctx = spawn_context()  # not fork: this process runs the coordinator's threads
        if self.store == "etcd":
            binary, why = etcd_binary()
            if binary is None:
                raise RuntimeError(why)
            from ds_recycle.runtime.shared.etcd_transport import job_name

            self.cluster = EtcdCluster(3, binary).start()
            self.address = transport.etcd_address(tuple(self.cluster.endpoints), job_name(TOKEN))
        else:
            ports: mp.Queue = ctx.Queue()
            self.server = ctx.Process(target=_serve_store, args=(self.host, ports), daemon=True)
            self.server.start()
            self.port = ports.get(timeout=120.0)
            self.address = f"{self.host}:{self.port}"
        n = self.shape.ranks
        C10dJobStore.connect(self.address, 0, TOKEN, timeout=60.0).open_job(n)
        layout = NodeLayout(self.shape.nodes, self.shape.per_node, self.shape.lease_seconds)
        self.root = tempfile.mkdtemp(prefix="ds_recycle_scale_beats_")
        self.coordinator = Coordinator(
            self.address,
            0,
            n,
            TOKEN,
            log=self.log.append,
            kill=lambda slot, incarnation: None,  # a member judged hung is counted from pending (the bench)
            policy=HeartbeatPolicy(min_timeout=max(10.0, 3 * self.shape.iteration_seconds)),
            nodes=layout,
            beats_dir=beats_dir(self.root, 0),
        )
        self.coordinator.start()
        self.events: mp.Queue = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.workers)]
        self.t0 = time.time() + 1.0
        for slot in range(self.shape.per_node):
            self.coordinator.rank_started(slot, 0, time.time())
        owners = [list(range(w, self.shape.nodes, self.workers)) for w in range(self.workers)]
        self.owner = {node: w for w, nodes in enumerate(owners) for node in nodes}
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(self.address, self.shape, owners[w], self.t0, self.root, self.commands[w], self.events),
            )
            for w in range(self.workers)
        ]
        for proc in self.procs:
            proc.start()
        self.pending_events: list[tuple] = []
        self.wait_for("ready", self.workers, timeout=600.0)

    def wait_for(self, kind: str, count: int, timeout: float) -> list[tuple]:
        """The next ``count`` events of ``kind`` (other events are kept for later calls)."""
        found = [e for e in self.pending_events if e[0] == kind][:count]
        for e in found:
            self.pending_events.remove(e)
        deadline = time.monotonic() + timeout
        while len(found) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(found)} of {count} {kind!r} events within {timeout:.0f} s")
            try:
                event = self.events.get(timeout=remaining)
            except Exception:
                continue
            if event[0] == kind:
                found.append(event)
            else:
                self.pending_events.append(event)
        return found

    def report(self) -> tuple[collections.Counter, collections.Counter, list[tuple]]:
        """The store operations so far of this process (the coordinator's) and of every worker (the
        nodes'), and the ranks' records since the last report."""
        for queue in self.commands:
            queue.put(("report", None))
        nodes: collections.Counter = collections.Counter()
        records: list[tuple] = []
        for event in self.wait_for("report", self.workers, timeout=120.0):
            nodes.update(event[2])
            records.extend(event[5])
        self.errors.extend(r for r in records if r[0] == "error")
        return collections.Counter(COUNTS), nodes, records

    def command(self, node: int, command: str, argument: int) -> None:
        self.commands[self.owner[node]].put((command, argument))

    def close(self) -> None:
        """End what the harness started (as far as it got): its workers, the coordinator, the
        store's server process or etcd's members, the beat directories."""
        for queue in self.commands:
            queue.put(("exit", None))
        for proc in self.procs:
            if proc.pid is None:
                continue
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.coordinator is not None:
            self.coordinator.stop(timeout=2.0)
        if self.server is not None:
            self.server.kill()
            self.server.join()
        if self.cluster is not None:
            self.cluster.stop()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def count_store_operations() -> None:
    """From now on, every store client this process opens through ``transport.connect`` counts into
    :data:`COUNTS` (a harness process's own clients: the bench's and its workers')."""
    if not getattr(transport.connect, "counting", False):
        transport.connect = _counting_connect(transport.connect)
