"""The coordinator protocol: the one owner of the store keys and the records written under them.

``ds-recycle launch`` hosts one store for the whole job and is the single owner of the list of
pending membership changes. Trainers post requests; the launcher validates them (the job token,
the slot, the kind) and appends the accepted ones, and the failures it detects itself, to
``pending``. At the end of every iteration the current members fix, with one ``compare_set``, which
pending changes take effect: the first member to reach the boundary decides for all, with one
``compare_set`` each (a member proposes the changes its watcher has seen; it reads no key). After a
failure the survivors post their progress and fix one recovery decision the same way.

Every key lives under ``job/<generation>/``: a restart from a checkpoint starts a new generation,
so nothing from the previous one is read again. This table is the whole protocol; no other module
spells a key.

==============================  =====================================================  ==========
key                             value                                                  writer
==============================  =====================================================  ==========
world_size                      N (the number of slots)                                launcher
nodes                           the number of nodes (world_size / nodes ranks each)    launcher
epoch/<n>                       :class:`Membership` JSON                               members
current_epoch                   n, advanced by compare_set from n-1                    members
request_count, request/<k>      :class:`Request` JSON (k from ``add(request_count,1)``)  anyone
change/<seq>                    one :class:`Change` of ``pending``, the job's          launcher
                                append-only list of changes: ``failed``, ``leave``,
                                ``join``, ``move`` (a migration), ``retired`` (a slot
                                that will not be started again)
alert                           counter: how many changes there are (moved on after    launcher
                                their keys are written): a reader reads only new ones
node_alert/<node>/<k>           set for every node, in one write, when ``alert`` is k;  launcher
                                the node's agent blocks on its own next one and copies (its own
                                the changes into the node's store (below): every        at stop)
                                change wakes every node, and no one polls for changes
decision/<n>/<i>                :class:`Decision` for epoch n at the end of iteration i  members
progress/<n>/<slot>             a survivor's :class:`Progress` after a failure in n     members
progress_count/<n>              counter: survivors that posted their progress in n      members
recovery/<n>                    the survivors' :class:`Decision` after a failure in n  members
ready/<n>                       counter: members of epoch n ready to build its world   members
entered/<n>                     set by the member whose ``ready/<n>`` count completed    members
                                epoch n's members (the others block on it)
world/<n>/...                   the gloo rendezvous of epoch n's world                 torch
node_incarnation/<node>         counter: +1 per agent start of that node               agent
lease/<node>                    :class:`Lease` JSON, renewed by the node's agent, with  agent
                                its ranks' last :class:`Beat` (heartbeat, iteration    (node 0:
                                time: relayed from the node-local beat files)          coordinator)
domain/<node>                   the node's failure domain (``--domain``; "" for none)  agent
report_count, report/<k>        :class:`AgentReport` JSON: a rank started or exited    agent
kill_count/<node>, kill/<node>/<k>  slot and incarnation the node's agent must kill    launcher
ended/<node>                    the node's agent's exit code, written as it ends       agent
status                          :class:`StatusReport` JSON: the current plan (times,    the lowest
                                stragglers, Gantt), each slot's worker, the last       surviving
                                changes with their latencies (read by the status page)  member
==============================  =====================================================  ==========

The node's store (``DS_RECYCLE_NODE_STORE``, on 127.0.0.1, hosted by the node's agent:
:mod:`ds_recycle.runtime.node_watch`) holds a copy of what the ranks' failure watchers read, under the
same keys and generation prefix: ``change/<seq>``, the latest ``epoch/<n>`` with the boundary
``decision/<n-1>/<i>`` that made it, ``current_epoch``, ``alert``, and ``alert/<slot>/<k>``, set for
each of the node's slots when the copy's ``alert`` is k. A rank's watcher blocks on its own next one
(and sets it to wake itself when it stops). The decisions are taken on the job's store only.

The node's ranks also count there what the job's store then counts once per node: a survivor posts
``progress/<n>/<slot>`` and adds 1 to ``progress_count/<n>`` on the node's store; the one whose add
completes the node's survivors claims ``progress_forwarder/<n>`` on the node's store (its slot, by
``compare_set``), copies their posts to the job's store in one ``multi_set`` and adds their number
to the job's ``progress_count/<n>``; if the claimer dies, a node's survivor that sees its failure
claims it from it and copies them again. A member entering epoch n adds 1 to the node's ``ready/<n>``;
the one whose add completes the node's members adds their number to the job's ``ready/<n>``.

Two keys live outside every generation, at the store's root: ``generation`` (the generation the
coordinator runs; written once its ``job/<g>/`` keys are) and ``check_in/<node>`` (a
:class:`CheckIn`: an agent waiting for the coordinator to start a generation). A coordinator
restarted after its host died has a fresh store: it waits for every node's check-in and runs
generation max(last) + 1, so that no process of an earlier generation can write into the new one.

A rank never writes its heartbeat to the store: it writes it to a file in its node's beat
directory (``DS_RECYCLE_BEATS``, :mod:`ds_recycle.runtime.beats`), and its node's agent relays every
rank's last beat in its lease, one write per node and renewal instead of ten per rank and second.

With several nodes, node 0's agent hosts the store and the coordinator; every other node's agent
reports its ranks' starts and exits (``report/<k>``), holds a lease (``lease/<node>``), and carries
out the coordinator's kills (``kill/<node>/<k>``).

:class:`Store` is all the protocol needs of a store; torch's ``TCPStore`` (behind a
``PrefixStore``) is the one used, and another store with these methods can stand behind it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Protocol

ENV_STORE = "DS_RECYCLE_STORE"
"""``host:port`` of the coordinator store (set by ``ds-recycle launch``)."""
ENV_TOKEN = "DS_RECYCLE_TOKEN"
"""The job's secret; a request without it is refused."""
ENV_INCARNATION = "DS_RECYCLE_INCARNATION"
"""0 for a rank's first start, k after its k-th respawn: a process with k > 0 joins a running job."""
ENV_NODE_STORE = "DS_RECYCLE_NODE_STORE"
"""``127.0.0.1:port`` of the node's store, where the node's agent copies the job's changes for its
ranks' failure watchers (set by ``ds-recycle launch``)."""
ENV_BEATS = "DS_RECYCLE_BEATS"
"""The node-local directory where each rank writes its heartbeat (one file per slot) for its node's
agent to relay (set by ``ds-recycle launch``)."""
ENV_ALLOW_UNSAFE_PLACEMENT = "DS_RECYCLE_ALLOW_UNSAFE_PLACEMENT"
"""Set to 1 by ``ds-recycle launch --allow-unsafe-placement``: start even if one node holds every
replica of a stage (its loss then stops the job or restarts it from a checkpoint)."""
ENV_GENERATION = "DS_RECYCLE_GENERATION"
"""0 at first, +1 at every restart of the whole job from a checkpoint; the key prefix."""
ENV_RESUME = "DS_RECYCLE_RESUME"
"""``required`` when the agents restart every rank after the coordinator's host died: a rank that
finds no checkpoint to resume from exits 76 with a message instead of training from scratch."""

RESTART_EXIT_CODE = 75
"""A trainer exits with this code when training cannot go on in place (a stage lost every worker) and
a checkpoint exists: ``ds-recycle launch --respawn`` then restarts every rank from it."""
STOP_EXIT_CODE = 76
"""A trainer exits with this code when training cannot go on in place and there is no checkpoint to
restart from: the launcher stops the job (no respawn) and exits non-zero."""
JOIN_GIVEN_UP_EXIT_CODE = 77
"""A joiner exits with this code when a failure among the members stopped it before its state
arrived: the launcher publishes it as a failure (the members leave it out of their recovery) and
respawns it at once, without counting it as a failure of the process."""
HEARTBEAT_MIN_TIMEOUT_SECONDS = 10.0
"""Default floor of the hang timeout (the launcher's ``--heartbeat-min-timeout``)."""

LEAVE = "leave"
JOIN = "join"
FAILED = "failed"
PROBE = "probe"
"""A request, never a change: a member's peer stopped answering and no failure was published."""
MOVE = "move"
"""A migration: member ``slot`` leaves at the boundary that takes it, and the agent that ran it
starts a process for ``target`` on the same device, which joins as any respawn does."""
RETIRED = "retired"
"""A change, never a request: the agent will not start ``slot`` again (it kept failing, or a mover
left it), so a migration may fill it. It changes no membership."""
REQUEST_KINDS = (LEAVE, JOIN, PROBE, MOVE)
OUT_KINDS = (FAILED, LEAVE, MOVE)
"""The kinds of change that take a member out of the next epoch."""


STORE_TIMEOUT_SECONDS = 120.0
"""Bound on a blocking store operation of a trainer (the launcher's store is its own host or a
neighbour; a healthy operation takes microseconds)."""

CONNECT_TIMEOUT_SECONDS = 30.0
"""Bound on a client's connect, apart from the bound on its operations: c10d looks up the name of
the server's address at every connect (to describe its socket), and where the resolver drops a
burst of queries each lookup takes 5 s. A node's link, whose operations are bounded by the lease,
could not connect then (seen in bench/multinode.py, once each node's agent also opened its node
store's clients at the same time)."""

QUIET_STORE_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
"""The environment of every process that makes bounded store waits, from its start (c10d reads it
when torch loads). With c10d's warnings on, each ``wait`` that times out formats its socket for a
warning, and the formatting looks up both addresses' names: where the resolver does not answer, or
drops a burst of queries, 5 s per lookup. Measured in bench/control_plane.py at 256 ranks: the
survivors whose 0.25 s slice of the wait for the decision timed out as it was made held it 5-10 s
late (py-spy: getnameinfo under SocketImpl::waitForInput)."""


class Store(Protocol):
    """The store operations the protocol uses (torch.distributed.Store's names)."""

    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: str | bytes) -> None: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...

    def delete_key(self, key: str) -> bool: ...


def prefix(generation: int) -> str:
    return f"job/{generation}/"


def epoch_key(epoch: int) -> str:
    return f"epoch/{epoch}"


def decision_key(epoch: int, iteration: int) -> str:
    return f"decision/{epoch}/{iteration}"


def recovery_key(epoch: int) -> str:
    return f"recovery/{epoch}"


def progress_key(epoch: int, slot: int) -> str:
    return f"progress/{epoch}/{slot}"


def progress_count_key(epoch: int) -> str:
    return f"progress_count/{epoch}"


def progress_forwarder_key(epoch: int) -> str:
    """On the node's store only."""
    return f"progress_forwarder/{epoch}"


def change_key(seq: int) -> str:
    return f"change/{seq}"


def alert_key(slot: int, count: int) -> str:
    """In the node's store, set once its ``alert`` reached ``count``: what ``slot``'s failure
    watcher blocks on."""
    return f"alert/{slot}/{count}"


def node_alert_key(node: int, count: int) -> str:
    """Set once ``alert`` reached ``count``: what node ``node``'s agent blocks on."""
    return f"node_alert/{node}/{count}"


def ready_key(epoch: int) -> str:
    return f"ready/{epoch}"


def entered_key(epoch: int) -> str:
    return f"entered/{epoch}"


def world_prefix(epoch: int) -> str:
    """The prefix of epoch ``epoch``'s gloo rendezvous keys."""
    return f"world/{epoch}/"


def lease_key(node: int) -> str:
    return f"lease/{node}"


def domain_key(node: int) -> str:
    return f"domain/{node}"


def node_incarnation_key(node: int) -> str:
    return f"node_incarnation/{node}"


def report_key(index: int) -> str:
    return f"report/{index}"


def kill_count_key(node: int) -> str:
    return f"kill_count/{node}"


def kill_key(node: int, index: int) -> str:
    return f"kill/{node}/{index}"


def ended_key(node: int) -> str:
    return f"ended/{node}"


def check_in_key(node: int) -> str:
    """At the store's root (no generation prefix)."""
    return f"check_in/{node}"


def request_key(index: int) -> str:
    return f"request/{index}"


WORLD_SIZE = "world_size"
NODES = "nodes"
STATUS = "status"
CURRENT_EPOCH = "current_epoch"
REQUEST_COUNT = "request_count"
REPORT_COUNT = "report_count"
ALERT = "alert"
GENERATION = "generation"
"""At the store's root (no generation prefix)."""


def serve(host: str, port: int, timeout: float = STORE_TIMEOUT_SECONDS, use_libuv: bool = True) -> Store:
    """A TCPStore server for clients that connect to ``host:port`` (port 0: any free one; its
    ``port`` says which).

    Where ``host`` is an IPv4 address the server gets a listening socket of that family: on
    ``host`` alone if it is a loopback address (only this machine's processes reach it), else on
    every IPv4 interface. Anything else (a name, an IPv6 address) keeps c10d's own socket, which
    binds every interface. The server's one loop thread looks up the name of each peer it accepts
    (``getnameinfo``) and serves no one meanwhile. On c10d's own dual-stack socket a local peer is
    the v4-mapped ``::ffff:127.0.0.1``, which no hosts file names: every accept asks DNS, and a
    resolver that dropped a burst of queries silenced a whole job's store for 5 s per query (seen
    in bench/multinode.py under load). The hosts file answers for an IPv4 loopback peer.
    """
    import ipaddress
    import socket

    import torch.distributed as dist

    bound = timedelta(seconds=timeout)
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=bound, use_libuv=use_libuv)
    interface = host if address.is_loopback else "0.0.0.0"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((interface, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot listen on {interface}:{port} for the store: {exc.strerror}") from None
    port = listener.getsockname()[1]
    fd = listener.detach()
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=bound, use_libuv=use_libuv, master_listen_fd=fd
    )


def connect(
    address: str, generation: int | None, timeout: float = STORE_TIMEOUT_SECONDS, connect_timeout: float | None = None
) -> Store:
    """A new client of the job store at ``host:port``, under the generation's key prefix (None: the
    store's root), whose operations are bounded by ``timeout`` and its connect by ``connect_timeout``
    (default: ``timeout``, at least CONNECT_TIMEOUT_SECONDS). Each thread that may block in a store
    call needs a client of its own (a blocking call on a TCPStore client blocks every other thread
    using that client)."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_STORE}={address!r} must be host:port")
    if connect_timeout is None:
        connect_timeout = max(timeout, CONNECT_TIMEOUT_SECONDS)
    base = dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=connect_timeout), wait_for_workers=False
    )
    if timeout != connect_timeout:
        base.set_timeout(timedelta(seconds=timeout))
    return base if generation is None else dist.PrefixStore(prefix(generation), base)


def read_membership(store: Store, epoch: int | None = None) -> Membership:
    """Epoch ``epoch``'s membership (default: the current epoch's), read fresh from the store."""
    if epoch is None:
        epoch = int(store.get(CURRENT_EPOCH))
    return Membership.from_json(store.get(epoch_key(epoch)))


def read_present(store: Store, keys: list[str]) -> list[bytes | None]:
    """The values of ``keys`` (None for a missing one): one round trip when all exist (the steady
    state: a scan of every member's keys), one check per key otherwise."""
    if not keys:
        return []
    if store.check(keys):
        return list(store.multi_get(keys))
    return [store.get(key) if store.check([key]) else None for key in keys]


def read_pending(store: Store, known: list[Change] | None = None, count: int | None = None) -> list[Change]:
    """Every change so far: ``known`` (the first changes, as read before) and the ones after it;
    ``count``: the ``alert`` count, if just read."""
    known = known or []
    count = int(store.add(ALERT, 0)) if count is None else count
    if count <= len(known):
        return list(known)
    values = store.multi_get([change_key(seq) for seq in range(len(known), count)])
    return known + [Change.from_json(value) for value in values]


def append_changes(store: Store, start: int, changes: list[Change], nodes: int) -> int:
    """The launcher's one write of new changes (``start`` = how many there were), which wakes every
    node's agent (:func:`publish_changes`). Returns the new count."""
    keys, values = [change_key(c.seq) for c in changes], [c.to_json() for c in changes]
    return publish_changes(store, keys, values, len(changes), lambda k: [node_alert_key(n, k) for n in range(nodes)])


def publish_changes(
    store: Store, keys: list[str], values: list[str | bytes], added: int, alert_keys: Callable[[int], list[str]]
) -> int:
    """Write ``keys`` (``added`` new changes and what goes with them), then move ``alert`` on by
    ``added``, then set ``alert_keys(k)`` for each new count k, in one ``multi_set``: a waiter woken
    by its key reads everything written before it. Returns the new count."""
    store.multi_set(keys, values)
    count = int(store.add(ALERT, added))
    woken = [key for k in range(count - added + 1, count + 1) for key in alert_keys(k)]
    if woken:
        store.multi_set(woken, ["1"] * len(woken))
    return count


def alert_count_after(store: Store, key: str, seen: int) -> int:
    """The ``alert`` count once ``key``, a waiter's next alert key after ``seen`` changes, is set.
    A key set by a stop (the waiter woke itself, or an earlier waiter of its slot or node did) is
    deleted; then the count is read again, since the writer may have set the key for real just
    before the delete (it counts first)."""
    count = int(store.add(ALERT, 0))
    if count <= seen:
        store.delete_key(key)
        count = int(store.add(ALERT, 0))
    return count


def post_request(store: Store, request: Request) -> int:
    """Append ``request`` for the coordinator; returns its index."""
    index = int(store.add(REQUEST_COUNT, 1))
    store.set(request_key(index), request.to_json())
    return index


def read_decision(store: Store, key: str) -> Decision | None:
    return Decision.from_json(store.get(key)) if store.check([key]) else None


def left_at_boundary(membership: Membership, store: Store) -> set[int]:
    """The leavers that the boundary decision making ``membership`` took out, alive then (not
    failed in it). The members that reached the boundary first decided it, so a leaver may not have
    finished the iteration it closed: its death before it did is a failure of that iteration."""
    if membership.epoch == 0:
        return set()
    decision = read_decision(store, decision_key(membership.epoch - 1, membership.iteration))
    if decision is None or decision.next != membership:
        return set()
    return boundary_leavers(decision)


def boundary_leavers(decision: Decision) -> set[int]:
    """The leavers a boundary decision takes out, alive then (not failed in it)."""
    failed = {c.slot for c in decision.changes if c.kind == FAILED}
    return {c.slot for c in decision.changes if c.kind == LEAVE and c.slot not in failed}


def read_status_report(store: Store) -> StatusReport | None:
    return StatusReport.from_json(store.get(STATUS)) if store.check([STATUS]) else None


@dataclass(frozen=True)
class Membership:
    """The live slots of one epoch; epoch n runs from iteration ``iteration`` on."""

    epoch: int
    members: tuple[int, ...]
    iteration: int

    def to_json(self) -> str:
        """The members as runs of consecutive slots (``[first, end)`` pairs): a job of thousands of
        ranks with a few out is a few numbers, which every rank reads at every change."""
        runs: list[list[int]] = []
        for slot in sorted(self.members):
            if runs and runs[-1][1] == slot:
                runs[-1][1] = slot + 1
            else:
                runs.append([slot, slot + 1])
        return json.dumps({"epoch": self.epoch, "runs": runs, "iteration": self.iteration}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Membership:
        data = json.loads(text)
        members = tuple(slot for first, end in data["runs"] for slot in range(int(first), int(end)))
        return cls(int(data["epoch"]), tuple(sorted(members)), int(data["iteration"]))


@dataclass(frozen=True)
class Request:
    """A trainer asks to leave, or a new process asks to join, slot ``slot``; a member asks that
    ``slot`` move into ``target`` (a migration)."""

    kind: str
    slot: int
    token: str
    pid: int
    time: float
    target: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Request:
        data = json.loads(text)
        target = data.get("target")
        return cls(
            str(data["kind"]),
            int(data["slot"]),
            str(data["token"]),
            int(data["pid"]),
            float(data["time"]),
            None if target is None else int(target),
        )


@dataclass(frozen=True)
class AgentReport:
    """A node's agent tells the coordinator that one of its ranks started or exited."""

    kind: str
    """``started`` or ``exited``."""
    node: int
    node_incarnation: int
    slot: int
    incarnation: int
    pid: int
    code: int | None
    """Popen's convention for ``exited``; None for ``started``."""
    time: float
    token: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> AgentReport:
        data = json.loads(text)
        code = data["code"]
        return cls(
            str(data["kind"]),
            int(data["node"]),
            int(data["node_incarnation"]),
            int(data["slot"]),
            int(data["incarnation"]),
            int(data["pid"]),
            None if code is None else int(code),
            float(data["time"]),
            str(data["token"]),
        )


@dataclass(frozen=True)
class Beat:
    """A rank's last heartbeat: when it was written, and the rank's last measured iteration time."""

    time: float
    """Wall time of the beat (a trainer that exits dates its last one ahead: its teardown is no hang)."""
    iteration_seconds: float | None = None
    stopped: bool = False
    """The trainer stopped beating on purpose (it finished, or left and is exiting): the coordinator
    does not check the slot until a later beat arrives (a respawned process). Without it, a process
    whose teardown outlasts the heartbeat timeout is declared failed and killed."""

    def to_list(self) -> list:
        return [self.time, self.iteration_seconds, self.stopped]

    @classmethod
    def from_list(cls, row: list) -> Beat:
        time, seconds, stopped = row
        return cls(float(time), None if seconds is None else float(seconds), bool(stopped))


@dataclass(frozen=True)
class Lease:
    """A node's agent is alive: renewed every fraction of the lease timeout, with the last beat of
    each of the node's ranks that has one."""

    node_incarnation: int
    time: float
    beats: dict[int, Beat] = field(default_factory=dict)

    def to_json(self) -> str:
        beats = {str(slot): beat.to_list() for slot, beat in self.beats.items()}
        return json.dumps({"node_incarnation": self.node_incarnation, "time": self.time, "beats": beats})

    @classmethod
    def from_json(cls, text: str | bytes) -> Lease:
        data = json.loads(text)
        beats = {int(slot): Beat.from_list(row) for slot, row in data.get("beats", {}).items()}
        return cls(int(data["node_incarnation"]), float(data["time"]), beats)


@dataclass(frozen=True)
class CheckIn:
    """An agent waits for the coordinator to start a generation; ``last_generation`` is the one its
    ranks ran last (-1: none, a fresh agent)."""

    node: int
    last_generation: int
    token: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> CheckIn:
        data = json.loads(text)
        return cls(int(data["node"]), int(data["last_generation"]), str(data["token"]))


@dataclass(frozen=True)
class KillOrder:
    slot: int
    incarnation: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> KillOrder:
        data = json.loads(text)
        return cls(int(data["slot"]), int(data["incarnation"]))


@dataclass(frozen=True)
class Change:
    """One accepted membership change. ``time`` is when it happened (the failure was detected, the
    request was posted), for the detection-latency log."""

    seq: int
    kind: str
    slot: int
    time: float
    detail: str = ""
    target: int | None = None
    """The slot a ``move`` fills."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Change:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, c: dict) -> Change:
        target = c.get("target")
        return cls(
            int(c["seq"]),
            c["kind"],
            int(c["slot"]),
            float(c["time"]),
            c.get("detail", ""),
            None if target is None else int(target),
        )


def changes_to_json(changes: list[Change]) -> str:
    return json.dumps([asdict(c) for c in changes])


def changes_from_json(text: str | bytes) -> list[Change]:
    return [Change.from_dict(c) for c in json.loads(text)]


def retired_slots(changes: list[Change]) -> set[int]:
    """Slots a migration may fill: their last change is ``retired`` (their agent will not start
    them again) and no move fills them already. A move fills its target from its acceptance on,
    unless its mover fails before the move is decided (then it is void)."""
    last: dict[int, Change] = {}
    filled_at: dict[int, int] = {}
    moving: dict[int, int] = {}
    """Mover -> target, while the move may still be undecided."""
    for change in changes:
        last[change.slot] = change
        if change.kind == MOVE and change.target is not None:
            filled_at[change.target] = change.seq
            moving[change.slot] = change.target
        elif change.slot in moving:
            target = moving.pop(change.slot)
            if change.kind == FAILED:
                filled_at.pop(target, None)
    return {slot for slot, change in last.items() if change.kind == RETIRED and filled_at.get(slot, -1) < change.seq}


def moves_under_way(changes: list[Change], members: tuple[int, ...]) -> dict[int, int]:
    """Mover -> target of the accepted moves whose mover is still a member (not yet decided)."""
    last: dict[int, Change] = {}
    for change in changes:
        last[change.slot] = change
    return {slot: c.target for slot, c in last.items() if c.kind == MOVE and slot in members and c.target is not None}


GroupState = tuple[int, int]
"""A process group as a survivor holds it: ``(the epoch it was made in, the collectives posted on
it)``."""


@dataclass(frozen=True)
class Progress:
    """How far a survivor got when a failure stopped it: ``done`` iterations finished, and whether
    it had already stepped the in-flight iteration ``done``; and the groups it holds for its roles
    in the grid of epoch ``grid_epoch`` (:data:`GroupState` by role), by which the survivors agree
    which groups to keep (:func:`groups_to_remake`)."""

    done: int
    stepped: bool
    grid_epoch: int = -1
    groups: dict[str, GroupState] = field(default_factory=dict)

    def to_json(self) -> str:
        groups = {role: list(state) for role, state in sorted(self.groups.items())}
        return json.dumps([self.done, self.stepped, self.grid_epoch, groups], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Progress:
        done, stepped, grid_epoch, groups = json.loads(text)
        return cls(int(done), bool(stepped), int(grid_epoch), {r: (int(m), int(n)) for r, (m, n) in groups.items()})


GroupRoles = Callable[[int], tuple[str, ...]]
"""The roles of a slot's groups (its stage's and its pipeline's): the group of a role has the
role's live slots as members."""


def groups_to_remake(
    changed: set[int],
    roles_of: GroupRoles | None,
    epoch: int | None = None,
    posts: dict[int, Progress] | None = None,
    members: tuple[int, ...] = (),
) -> tuple[str, ...] | None:
    """The roles whose groups the next epoch makes afresh; every other role's group is kept (None:
    every group is made afresh, when the decider knows no roles).

    A role is remade when one of its slots ``changed`` (left, failed or joined). After a failure
    (``posts``: every survivor's progress in ``epoch``, by slot) also when its survivors do not all
    hold the same group with the same number of collectives posted on it: a collective that some
    members posted and others never will is stuck on the group for good, and a later one would meet
    it. A survivor that holds the grid of another epoch than ``epoch`` (a failure stopped it while
    it entered one), and a member of the next epoch that posted nothing (``members``: a joiner),
    have every role of their slots remade."""
    if roles_of is None:
        return None
    remade = {role for slot in changed for role in roles_of(slot)}
    if posts is not None:
        remade.update(role for slot in members if slot not in posts for role in roles_of(slot))
    held: dict[str, set[GroupState]] = {}
    for slot, post in (posts or {}).items():
        if post.grid_epoch != epoch:
            remade.update(roles_of(slot))
        for role, state in post.groups.items():
            held.setdefault(role, set()).add(state)
    remade |= {role for role, states in held.items() if len(states) > 1}
    return tuple(sorted(remade))


@dataclass(frozen=True)
class Decision:
    """What the members of epoch ``epoch`` agreed at the end of iteration ``iteration``: the
    changes that take effect (``applied`` = seqs of ``pending`` taken so far) and, if any, the
    next membership."""

    epoch: int
    iteration: int
    applied: int
    changes: tuple[Change, ...] = field(default_factory=tuple)
    next: Membership | None = None
    remade: tuple[str, ...] | None = None
    """The roles whose groups the next epoch makes afresh (:func:`groups_to_remake`); None: all."""

    def holders(self) -> tuple[int, ...]:
        """The members of the next epoch that hold the trained state: all but the slots this
        decision admits. Joiners copy their state from them. Every member of the next epoch reads
        the same decision, so they agree on it, whichever epoch each had entered to the end (a
        failure can stop some members of an epoch in its state transfer while others train in it;
        a joiner stopped before its state arrived gives up its join, so it is never among them)."""
        joined = {c.slot for c in self.changes if c.kind == JOIN}
        return tuple(s for s in self.next.members if s not in joined)

    def to_json(self) -> str:
        return json.dumps(
            {
                "epoch": self.epoch,
                "iteration": self.iteration,
                "applied": self.applied,
                "changes": [asdict(c) for c in self.changes],
                "next": None if self.next is None else json.loads(self.next.to_json()),
                "remade": None if self.remade is None else list(self.remade),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        data = json.loads(text)
        nxt = data["next"]
        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            int(data["applied"]),
            tuple(Change.from_dict(c) for c in data["changes"]),
            None if nxt is None else Membership.from_json(json.dumps(nxt)),
            None if data.get("remade") is None else tuple(str(r) for r in data["remade"]),
        )


WorkerPair = tuple[int, int]
"""``(pipeline, stage)``, as the planner names a worker."""


def _workers(items) -> tuple[WorkerPair, ...]:
    return tuple((int(p), int(s)) for p, s in items)


@dataclass(frozen=True)
class ChangeReport:
    """One membership change as the ranks logged it (a :class:`~ds_recycle.runtime.events.MembershipChange`)."""

    epoch: int
    iteration: int
    """The first iteration of the new epoch."""
    left: tuple[WorkerPair, ...]
    failed: tuple[WorkerPair, ...]
    joined: tuple[WorkerPair, ...]
    detection_seconds: float | None
    switch_seconds: float
    recovery_seconds: float | None
    """From the failure to running on the new plan (None for a leave or a join)."""
    rolled_back: bool
    time: float

    @classmethod
    def from_dict(cls, data: dict) -> ChangeReport:
        def seconds(value) -> float | None:
            return None if value is None else float(value)

        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            _workers(data["left"]),
            _workers(data["failed"]),
            _workers(data["joined"]),
            seconds(data["detection_seconds"]),
            float(data["switch_seconds"]),
            seconds(data["recovery_seconds"]),
            bool(data["rolled_back"]),
            float(data["time"]),
        )


@dataclass(frozen=True)
class GanttOp:
    """One op of the plan on worker ``(pipeline, stage)``, from ``start`` to ``end``."""

    pipeline: int
    stage: int
    kind: str
    home: int
    mb: int
    start: float
    end: float

    def to_list(self) -> list:
        return [self.pipeline, self.stage, self.kind, self.home, self.mb, self.start, self.end]

    @classmethod
    def from_list(cls, row: list) -> GanttOp:
        p, s, kind, home, mb, start, end = row
        return cls(int(p), int(s), str(kind), int(home), int(mb), float(start), float(end))


@dataclass(frozen=True)
class PlanReport:
    """The plan the members run: its predicted iteration time against fault-free and the lower
    bound (in ``unit``), the workers it routes around, and its Gantt chart."""

    plan_id: str
    unit: str
    """``ms`` for a cost model of measured (or emulated) durations, ``cost units`` before one."""
    failed: tuple[WorkerPair, ...]
    slow: tuple[tuple[int, int, float], ...]
    """Stragglers the plan routes around: ``(pipeline, stage, factor)``."""
    predicted_iteration_time: float
    fault_free_iteration_time: float
    lower_bound: float
    rerouted_microbatches: int
    gantt: tuple[GanttOp, ...]
    gantt_omitted: int = 0
    """Ops left out of ``gantt`` to keep the record small (the last workers' ops)."""

    @classmethod
    def from_dict(cls, data: dict) -> PlanReport:
        return cls(
            str(data["plan_id"]),
            str(data["unit"]),
            _workers(data["failed"]),
            tuple((int(p), int(s), float(f)) for p, s, f in data["slow"]),
            float(data["predicted_iteration_time"]),
            float(data["fault_free_iteration_time"]),
            float(data["lower_bound"]),
            int(data["rerouted_microbatches"]),
            tuple(GanttOp.from_list(row) for row in data["gantt"]),
            int(data.get("gantt_omitted", 0)),
        )


@dataclass(frozen=True)
class StatusReport:
    """What the ranks publish for the status page (``status``): written at start, at every
    membership change and at every change of the plan's cost model, by one member (the lowest
    that ran the change), which carries the previous record's changes over."""

    epoch: int
    iteration: int
    pipelines: int
    stages: int
    microbatches: int
    samples_per_iteration: int
    workers: tuple[WorkerPair, ...]
    """Each slot's worker, by slot."""
    plan: PlanReport
    changes: tuple[ChangeReport, ...]
    """The last few, oldest first."""
    writer: int
    time: float

    def to_json(self) -> str:
        data = asdict(self)
        data["plan"]["gantt"] = [op.to_list() for op in self.plan.gantt]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StatusReport:
        data = json.loads(text)
        return cls(
            int(data["epoch"]),
            int(data["iteration"]),
            int(data["pipelines"]),
            int(data["stages"]),
            int(data["microbatches"]),
            int(data["samples_per_iteration"]),
            _workers(data["workers"]),
            PlanReport.from_dict(data["plan"]),
            tuple(ChangeReport.from_dict(c) for c in data["changes"]),
            int(data["writer"]),
            float(data["time"]),
        )
