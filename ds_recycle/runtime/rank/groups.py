"""ReCycle's grid: the live workers of one epoch, their torch ranks, and their process groups.

DeepSpeed's ``PipelineParallelGrid`` needs ``world = P x D``; after a failure the world is smaller.
:class:`RecycleGrid` keeps the logical topology (every worker is a slot of the original P x D
grid), maps live slots to the ranks of the current world, and holds one data-parallel group per
stage among its live workers, plus a pipe group for every pipeline that is whole. It answers the
parts of DeepSpeed's grid API that the engine uses, so it replaces ``engine.grid`` and
``engine.mpu`` in place.

Every epoch gets a fresh world on its own store prefix (``world/<epoch>/``): the old default group
is destroyed and the groups it does not keep go to a graveyard, never reused and never released
from a thread that might block on them (docs/design.md, "Process groups"). A stage's or a
pipeline's group is kept from epoch to epoch (:class:`KeptGroup`: taken out of torch's registry
before the world is left and registered again with the new world's ranks) unless the decision that
made the epoch remakes its role (:func:`~ds_recycle.runtime.shared.policy.groups_to_remake`): a member
left, failed or joined, or, after a failure, its survivors do not all report the same collectives
posted on it (one that only some posted is stuck on the group, and would meet a later one). A
stage's or pipeline's group is made by its members alone, on a store connection of its own, so that
a later epoch's first op on it never waits behind a lookup of a dead worker's address on the
connection its world shares with the pairs; a kept group costs nothing.

Every group ReCycle makes connects lazily (gloo's ``TORCH_GLOO_LAZY_INIT``): creating it publishes
this rank's address and returns, and a pair of ranks connects at its first op. An eager gloo group
waits in its constructor, a C++ store wait that nothing can interrupt, for every member's address:
a member that died after the epoch was entered held every survivor there for the group timeout.
Lazily, that wait happens inside an op. A collective runs in gloo's worker thread, which the rank
waits for against the failure flag (``runtime/rank/waiting.py``). A p2p op does not: it connects its
pair in the calling thread and waits there (gloo's ``Pair::verifyConnected``) until the peer
connects too, so a rank's first send to a peer would wait for the peer to reach its own first op
on the pair: a rendezvous that an asynchronous send must not be, and a wait that a dead peer ends
only at the group timeout. So routed p2p runs on :class:`PairLinks`: one two-rank group per pair of
workers that exchange messages, connected by one one-element all-reduce (a collective) that both
ranks start at the same point of the program and wait for against the failure flag. A rank
connects only its peers, never the whole world: its store operations per epoch grow with its
peers, not with the world. A pair's group is kept from epoch to epoch while both its workers stay
members: a failure makes new pairs only where the plan re-routes, and a worker's other pairs cost
nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ds_recycle.planner.plan import Worker
from ds_recycle.runtime.rank import communication, exit_guard
from ds_recycle.runtime.rank.communication import GLOO, NCCL
from ds_recycle.runtime.rank.waiting import WAIT_BOUND_SECONDS
from ds_recycle.runtime.shared.job_store import JobStore
from ds_recycle.runtime.shared.keys import world_prefix
from ds_recycle.runtime.shared.policy import GroupRoles
from ds_recycle.runtime.shared.records import Decision, GroupState, Membership

GROUP_TIMEOUT_SECONDS = WAIT_BOUND_SECONDS
"""Every group's op timeout but the pairs': a backstop only, failure detection does not wait for
it (the same bound as a :class:`~ds_recycle.runtime.rank.waiting.Waiter`'s wait)."""


def bury(objects) -> None:
    """Keep process groups (and their pending work) alive until the process ends, and beyond: a gloo
    group released while an op on it is stuck blocks the releasing thread, and one released at
    interpreter exit with a stuck op aborts the process. They are never freed; each costs a few
    file descriptors and threads."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


LAZY_INIT_VARIABLE = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def lazy_connections() -> Iterator[None]:
    """gloo groups created inside connect lazily (torch reads the variable at each creation)."""
    before = os.environ.get(LAZY_INIT_VARIABLE)
    os.environ[LAZY_INIT_VARIABLE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LAZY_INIT_VARIABLE]
        else:
            os.environ[LAZY_INIT_VARIABLE] = before


def new_group(ranks: list[int], timeout: float):
    """A subgroup of the current world that connects lazily."""
    with lazy_connections():
        return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))


def rebuild_world(
    store: JobStore,
    membership: Membership,
    slot: int,
    timeout: float = GROUP_TIMEOUT_SECONDS,
    kept: Iterable[KeptGroup] = (),
    backend: str = GLOO,
) -> None:
    """Leave the current world (if any) and join the world of ``membership`` on its own prefix.
    Returns at once: the world connects lazily. ``kept``: groups of the current world that the new
    one keeps (:meth:`RecycleGrid.keep`): they are taken out of torch's registry before it leaves
    the world, which would shut them down, and :meth:`RecycleGrid.build` registers them again.

    The world gets its own connection to the store (:meth:`JobStore.world_rendezvous`): gloo looks
    up a peer's address in its own threads, and a lookup of a dead peer's address blocks its
    connection until the group timeout; on the caller's connection it would block the membership
    protocol too.

    On NCCL (``backend``) nothing is kept: the world's communicators and its pairs' are aborted
    (:func:`abort_communicators`), never destroyed or waited for, and the new world's are made at
    their first op."""
    if dist.is_initialized():  # the previous epoch's, or a joiner's fake world
        _leave_world(kept)
    global _leaving_at_exit
    if not _leaving_at_exit:
        _leaving_at_exit = True
        atexit.register(_leave_world_at_exit)
    with lazy_connections():
        dist.init_process_group(
            backend,
            store=store.world_rendezvous(membership.epoch),
            rank=membership.members.index(slot),
            world_size=len(membership.members),
            timeout=datetime.timedelta(seconds=timeout),
        )


_leaving_at_exit = False

_nccl_pairs: list = []
"""The NCCL pair groups made in the current world: :func:`abort_communicators` aborts them too."""

_aborted: set[int] = set()
"""The ids of the groups whose abort was started (each is aborted once, and buried)."""


def abort_communicators(on_done: Callable[[float], None] | None = None) -> bool:
    """Start aborting every NCCL communicator of the current world, its groups' and its pairs', in
    a thread of its own, and return at once (True when there was any to abort). A failure leaves
    ops on a dead or stopped peer spinning on the GPU until their communicator is aborted; the
    abort itself was seen to take 0.3 to 3 s over sockets, and once over 120 s on a GPU (torch's
    own wait for it timed out), so nothing waits for it: the groups are buried, and the next
    world's communicators are new ones. ``on_done(seconds)`` is called in that thread when the abort
    returns. Nothing on gloo (:mod:`~ds_recycle.runtime.rank.communication`)."""
    if not dist.is_initialized() or dist.get_backend() != NCCL:
        return False
    groups = [g for g in [*c10d._world.pg_map.keys(), *_nccl_pairs] if id(g) not in _aborted]
    _nccl_pairs.clear()
    if not groups:
        return False
    bury(groups)
    _aborted.update(id(g) for g in groups)

    def abort() -> None:
        seconds = communication.abort_groups(groups)
        if on_done is not None:
            on_done(seconds)

    thread = threading.Thread(target=abort, name="recycle-nccl-abort", daemon=True)
    thread.start()
    exit_guard.abandoned(thread)  # an exit while it is still inside NCCL skips C++ teardown
    return True


def forget_world() -> None:
    """Take every group of the current world out of torch's registry, destroying and aborting none
    (on NCCL, :func:`abort_communicators` did that): as torch's ``_abort_process_group`` does after
    its abort, which waits for the abort."""
    world = c10d._world
    c10d._update_default_pg(None)
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def _leave_world_at_exit() -> None:
    """At exit the last world is left as every earlier one was: buried and unregistered. torch's
    registry of groups is a C++ static, destroyed after the interpreter: a group still in it is
    destroyed there, and its destructor joins gloo's worker threads. One blocked in an op of a dead
    peer held a joiner that gave up its join in its exit for the group timeout (seen here); a rank that
    had finished training once ended by SIGABRT at exit, just after its peer's (CI, after a node's
    loss and re-admission)."""
    if dist.is_initialized():
        _leave_world()


def _leave_world(kept: Iterable[KeptGroup] = ()) -> None:
    """Leave the current world: its groups buried; on NCCL their communicators aborted and the
    groups unregistered, on gloo ``kept`` taken out of the registry and the rest destroyed."""
    bury(c10d._world.pg_map.keys())
    if dist.get_backend() == NCCL:
        abort_communicators()
        forget_world()
        return
    for group in kept:
        group.withdraw()
    dist.destroy_process_group()


PAIR_PREFIX = "pair"
"""The store prefix of the pair groups: ``pair/<k>/<epoch>/<lower slot>_<higher slot>/`` for the
k-th :class:`PairLinks` of a process (several engines can share one process) and the epoch in
which both workers made the pair's group."""

PAIR_TIMEOUT_SECONDS = 7 * 24 * 3600.0
"""A pair group's gloo timeout: never reached. gloo closes a pair when any op on it times out, and a
kept pair carries the ops a failure abandoned in earlier epochs (each epoch its own tag), which no
one completes: with the group timeout it would close 120 s after a failure. The waits on a pair's
ops are bounded by :class:`~ds_recycle.runtime.rank.waiting.Waiter` instead."""

_links_made = 0
"""How many :class:`PairLinks` this process made: each engine's k-th, in the same order on every rank."""


@dataclass
class Pair:
    """One pair's two-rank group and its connection."""

    group: object
    """gloo: the pair's group. NCCL: the group of the messages this worker sends to the peer."""
    iteration: int
    """The iteration at whose start (``global_steps``) this worker posted the connecting all-reduce."""
    connected: bool = False
    inbound: object | None = None
    """NCCL: the group of the messages this worker receives from the peer. An NCCL communicator
    runs its ops one after another in the order posted; with one for both directions, a send
    posted before a receive of the peer's send (a stage sending its next activation before it takes
    the gradient of the previous one) could wait on the peer's send posted before its receive."""


@dataclass
class _Works:
    """Several ops waited for as one."""

    works: list

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


@dataclass
class PairLinks:
    """Routed p2p's transport: a two-rank gloo group per peer this worker exchanges messages with
    (see the module doc), kept from epoch to epoch while both workers stay members.

    A pair's group outlives its world: it is made on the job's store under a prefix both workers
    derive alike (the slots and the epoch in which they make it), and each epoch's messages carry
    the epoch as their tag. A failure leaves abandoned sends and receives on a pair (posted by one
    side only); under an older tag they never match a later message, and with
    :data:`PAIR_TIMEOUT_SECONDS` they never time out and close the pair.

    Entering an epoch forgets a pair whose peer is not a member (a respawned or re-joined process is
    a new peer), every pair when this process holds another slot, and a pair connected at or after
    the epoch's first iteration. Both workers of a pair connect it at the start of the same
    iteration; one that every member of the new epoch finished was connected by both, while one
    connected later may have been cut short on either side (a peer stopped before its own connect;
    a connection waiting for a dead worker's address on the same store client), so both forget it
    alike and make a new group when they next need it. On a world that is not gloo's (NCCL connects
    its pairs itself; a joiner's placeholder world carries nothing) the messages go on the world
    group."""

    index: int
    slot: int = -1
    epoch: int = -1
    members: tuple[int, ...] = ()
    store: object | None = None
    """This epoch's client of the job's store (the world's own); None: p2p on the world group."""
    nccl: bool = False
    """Whether the current world is NCCL's (two groups per pair, :attr:`Pair.inbound`)."""
    pairs: dict[int, Pair] = field(default_factory=dict)
    """By peer slot."""

    @classmethod
    def create(cls) -> PairLinks:
        """The links of a new engine; every rank makes its k-th at the same point."""
        global _links_made
        _links_made += 1
        return cls(_links_made - 1)

    def enter(self, membership: Membership, slot: int) -> None:
        """Take the current world (``membership``'s) for this worker, forgetting the pairs that
        cannot be kept (see the class doc; on NCCL none is: leaving the world aborted them)."""
        backend = dist.get_backend()
        gloo = backend == dist.Backend.GLOO
        members = set(membership.members)
        for peer, pair in list(self.pairs.items()):
            if slot != self.slot or not gloo or peer not in members or pair.iteration >= membership.iteration:
                del self.pairs[peer]  # buried when made
        self.slot, self.epoch, self.members = slot, membership.epoch, membership.members
        self.store = None
        self.nccl = backend == dist.Backend.NCCL
        if gloo or self.nccl:
            world_store = c10d._get_default_store()
            self.store = world_store.underlying_store if isinstance(world_store, dist.PrefixStore) else world_store

    def connect(self, peers, waiter, iteration: int) -> None:
        """Connect this worker to every rank of ``peers`` (ranks of the current world) it is not
        connected to yet. Each of them must call this with this worker among its ``peers`` at the
        same point of the program (the start of iteration ``iteration``, or of a re-sync): the
        connection is a collective of the pair."""
        if self.store is None:
            return
        new = sorted(s for s in {self.members[rank] for rank in peers} - {self.slot} if not self._connected(s))
        cut_short = [peer for peer in new if peer in self.pairs]
        if cut_short:  # a connection cut short ends its epoch, and entering the next forgets the pair
            raise RuntimeError(
                f"slot {self.slot}: pairs with slots {cut_short} were made but not connected in this epoch"
            )
        if self.nccl:
            self._connect_nccl(new, waiter, iteration)
            return
        # Every group first, then every connection: a group publishes its address on the epoch's
        # store client, which a connection's lookup of a peer's address holds until the peer
        # publishes it (a dead one: until the timeout), so a group made after a connection could
        # wait there, in C++, beyond the failure flag.
        with lazy_connections():
            for peer in new:
                self.pairs[peer] = Pair(self._group(peer), iteration)
                bury([self.pairs[peer]])
        works = [(peer, self.pairs[peer].group.allreduce([torch.zeros(1)])) for peer in new]
        for peer, work in works:
            waiter.collective(lambda work=work: work, f"connecting slot {self.slot} to slot {peer}")
            self.pairs[peer].connected = True

    def _connect_nccl(self, new: list[int], waiter, iteration: int) -> None:
        """NCCL makes a communicator at its first op, a rendezvous of its two ranks in C++: one
        message each way per new pair, the pairs in one order on every rank (by their slots, as the
        pairs of a lock order), each waited for against the failure flag."""
        device = communication.local_device(NCCL)
        for peer in new:
            low = self.slot < peer
            outbound, inbound = self._nccl_group(peer, outbound=True), self._nccl_group(peer, outbound=False)
            self.pairs[peer] = Pair(outbound, iteration, inbound=inbound)
            _nccl_pairs.extend([outbound, inbound])
            bury([self.pairs[peer]])
            other = 1 if low else 0
            sent, received = torch.zeros(1, device=device), torch.zeros(1, device=device)

            def start(outbound=outbound, inbound=inbound, sent=sent, received=received, low=low, other=other):
                # the low slot's outbound group is the high slot's inbound one: both take it first
                if low:
                    return _Works([outbound.send([sent], other, 0), inbound.recv([received], other, 0)])
                return _Works([inbound.recv([received], other, 0), outbound.send([sent], other, 0)])

            waiter.collective(start, f"connecting slot {self.slot} to slot {peer}")
            self.pairs[peer].connected = True

    def _nccl_group(self, peer: int, outbound: bool):
        """The two-rank NCCL group of the messages from one worker of the pair to the other."""
        sender, receiver = (self.slot, peer) if outbound else (peer, self.slot)
        low, high = sorted((self.slot, peer))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=PAIR_TIMEOUT_SECONDS)
        prefix = f"{PAIR_PREFIX}/{self.index}/{self.epoch}/{low}_{high}/{sender}to{receiver}/"
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, self.store), 0 if self.slot == low else 1, 2, options)

    def _connected(self, peer: int) -> bool:
        return peer in self.pairs and self.pairs[peer].connected

    def _group(self, peer: int):
        low, high = sorted((self.slot, peer))
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=PAIR_TIMEOUT_SECONDS)
        options._threads = 1
        options._devices = _pair_devices()
        store = dist.PrefixStore(f"{PAIR_PREFIX}/{self.index}/{self.epoch}/{low}_{high}/", self.store)
        return dist.ProcessGroupGloo(store, 0 if self.slot == low else 1, 2, options)

    def isend(self, tensor: torch.Tensor, dst: int):
        """Send to rank ``dst`` of the current world."""
        pair = self._linked(dst)
        if pair is None:
            return dist.isend(tensor, dst=dst)
        return pair.group.send([tensor], int(self.members[dst] > self.slot), 0 if self.nccl else self.epoch)

    def irecv(self, tensor: torch.Tensor, src: int):
        """Receive from rank ``src`` of the current world."""
        pair = self._linked(src)
        if pair is None:
            return dist.irecv(tensor, src=src)
        group = pair.inbound if self.nccl else pair.group
        return group.recv([tensor], int(self.members[src] > self.slot), 0 if self.nccl else self.epoch)

    def _linked(self, rank: int) -> Pair | None:
        if self.store is None:
            return None
        peer = self.members[rank]
        if not self._connected(peer):
            connected = sorted(self.members.index(s) for s in self.pairs if self._connected(s))
            raise RuntimeError(
                f"routed p2p between ranks {self.members.index(self.slot)} and {rank}: the pair was not connected "
                f"(connected: {connected}); every pair a plan uses must be connected first (PeerChannel.connect)"
            )
        return self.pairs[peer]


def _pair_devices() -> list:
    """A pair group's own gloo devices (lazily connecting groups on one device would share their
    sequence numbers), on the interfaces ``GLOO_SOCKET_IFNAME`` names, as torch picks them for a
    group it makes itself; else on the address the host's name resolves to."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:
        return [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True) for name in interfaces.split(",")]
    return [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]


def stage_role(stage: int) -> str:
    return f"stage{stage}"


def pipe_role(pipeline: int) -> str:
    return f"pipe{pipeline}"


def group_roles(topo) -> GroupRoles:
    """The roles of a slot's groups in DeepSpeed's pipe-data topology ``topo``: its stage's
    data-parallel group and its pipeline's pipe group."""

    def roles(slot: int) -> tuple[str, ...]:
        coord = topo.get_coord(slot)
        return stage_role(coord.pipe), pipe_role(coord.data)

    return roles


MADE_NAME = "recycle"
"""The prefix of the name of a stage or pipe group made in a world (``recycle_<role>_<epoch>_<k>``
for the k-th made in the process)."""

_groups_made: dict[tuple[str, int], int] = {}
"""How many groups of a role this process made in an epoch: several engines can share a process,
and each grid makes its groups in the same order on every member."""


@dataclass
class KeptGroup:
    """A stage or pipe group carried from one world into the next: torch's registry entries of the
    group and the slots of its ranks, by which it is registered again with the new world's ranks."""

    role: str
    group: object
    slots: tuple[int, ...]
    """The members' slots, by group rank."""
    made_in: int
    registry: dict[str, object] = field(default_factory=dict)
    """The group's entries in torch's tables (``pg_map``, ``pg_backend_config``) and its name."""

    def withdraw(self) -> None:
        """Take the group out of torch's registry of the current world."""
        world = c10d._world
        self.registry = {
            "pg_map": world.pg_map.pop(self.group),
            "pg_backend_config": world.pg_backend_config.pop(self.group, None),
        }
        self.registry["name"] = world.pg_names.pop(self.group)
        world.pg_group_ranks.pop(self.group, None)
        world.pg_coalesce_state.pop(self.group, None)
        tag = world.pg_to_tag.pop(self.group, None)
        if tag is not None and self.group in world.tags_to_pg.get(tag, []):
            world.tags_to_pg[tag].remove(self.group)

    def enlist(self, membership: Membership) -> object:
        """Register the group in the current world (``membership``'s), its ranks by their slots."""
        world = c10d._world
        name = self.registry["name"]  # unique in the process: it names the world it was made in
        world.pg_map[self.group] = self.registry["pg_map"]
        if self.registry["pg_backend_config"] is not None:
            world.pg_backend_config[self.group] = self.registry["pg_backend_config"]
        world.pg_names[self.group] = name
        world.pg_group_ranks[self.group] = {membership.members.index(s): i for i, s in enumerate(self.slots)}
        world.pg_to_tag[self.group] = f"ptd:{name}"
        world.tags_to_pg.setdefault(f"ptd:{name}", []).append(self.group)
        return self.group


def _on_gloo_with_a_store() -> bool:
    """Whether the current world is gloo's on a store that can open another connection."""
    return _on_a_store() and dist.get_backend() == dist.Backend.GLOO


def _on_a_store() -> bool:
    """Whether the current world is gloo's or NCCL's on a store that can open another connection
    (not a joiner's placeholder world)."""
    if not dist.is_initialized() or dist.get_backend() not in (dist.Backend.GLOO, dist.Backend.NCCL):
        return False
    store = c10d._get_default_store()
    return isinstance(store, dist.PrefixStore) and hasattr(store.underlying_store, "clone")


@dataclass
class RecycleGrid:
    """The grid of one epoch. Build it with :meth:`build` on every member, in the same epoch."""

    topo: object
    """DeepSpeed's ``PipeDataParallelTopology`` of the full job (axes ``pipe`` and ``data``)."""
    membership: Membership
    slot: int
    timeout: float
    stage_groups: dict[int, object] = field(default_factory=dict)
    pipe_groups: dict[int, object] = field(default_factory=dict)
    links: PairLinks | None = None
    """Routed p2p's pair groups, kept from the engine's previous grid."""
    made_in: dict[str, int] = field(default_factory=dict)
    """By role (:func:`group_roles`) of this worker: the epoch in which its group was made."""

    @classmethod
    def build(
        cls,
        topo,
        membership: Membership,
        slot: int,
        timeout: float,
        links: PairLinks | None = None,
        kept: dict[str, KeptGroup] | None = None,
        remade: tuple[str, ...] | None = None,
    ) -> RecycleGrid:
        """Create this epoch's groups; every member calls it in the same order. ``links``: the
        engine's previous grid's (its pairs whose peers stay members are kept), or None for a new
        engine's. ``remade``: the roles whose groups the decision that made the epoch makes afresh
        (None: all); every other role's group is kept by its members (``kept``, from
        :meth:`keep`); the new groups are made by their members alone."""
        grid = cls(topo, membership, slot, timeout)
        if _on_a_store() and not _on_gloo_with_a_store():
            remade = None  # NCCL keeps no group (leaving a world aborted them all): every role's is new
        for stage in range(grid.pipe_parallel_size):
            workers = grid.live_workers(stage)
            grid.stage_groups[stage] = grid._group(stage_role(stage), workers, kept or {}, remade)
        for pipeline in range(grid.data_parallel_size):
            stages = [(pipeline, s) for s in range(grid.pipe_parallel_size)]
            if all(grid.is_live(w) for w in stages):
                grid.pipe_groups[pipeline] = grid._group(pipe_role(pipeline), stages, kept or {}, remade)
        grid.links = links if links is not None else PairLinks.create()
        grid.links.enter(membership, slot)
        return grid

    def _group(self, role: str, workers: list[Worker], kept: dict[str, KeptGroup], remade: tuple[str, ...] | None):
        slots = tuple(self.slot_of(w) for w in workers)
        if remade is None or role in remade:
            if self.slot in slots:
                self.made_in[role] = self.membership.epoch
            ranks = [self.rank_of(w) for w in workers]
            if not _on_a_store():  # a joiner's placeholder world: nothing to keep
                return new_group(ranks, self.timeout)
            return self._keepable_group(role, ranks)
        if self.slot not in slots:
            return dist.GroupMember.NON_GROUP_MEMBER
        if role not in kept or kept[role].slots != slots:
            raise RuntimeError(
                f"slot {self.slot}: epoch {self.membership.epoch} keeps the group of {role} (slots {list(slots)}), "
                f"which this worker does not hold: the decision that made the epoch should have remade it"
            )
        self.made_in[role] = kept[role].made_in
        return kept[role].enlist(self.membership)

    def _keepable_group(self, role: str, ranks: list[int]):
        """A group that later epochs may keep, made by its members only, on a store connection of
        its own: gloo looks up a peer's address on the store at the first op between them, and a
        lookup of a dead worker's address (the world's or a pair's, on the epoch's shared
        connection) holds that connection for good; a group kept into a later epoch, first used
        there, would wait behind it."""
        world_rank = self.membership.members.index(self.slot)
        if world_rank not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        shared = c10d._get_default_store()
        store = dist.PrefixStore(world_prefix(self.membership.epoch), shared.underlying_store.clone())
        made = (role, self.membership.epoch)
        _groups_made[made] = _groups_made.get(made, 0) + 1
        name = f"{MADE_NAME}_{role}_{self.membership.epoch}_{_groups_made[made]}"
        with lazy_connections():
            group, _ = c10d._new_process_group_helper(
                len(ranks),
                ranks.index(world_rank),
                ranks,
                dist.get_backend(),
                store,
                name,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
        c10d._world.pg_group_ranks[group] = {rank: i for i, rank in enumerate(ranks)}
        return group

    def keep(self, decision: Decision, slot: int) -> dict[str, KeptGroup]:
        """The groups of this worker that the epoch ``decision`` makes keeps: every role of this
        worker's that the decision does not remake, when this grid is of the decision's epoch, this
        process still holds ``slot``, and its groups are gloo's."""
        if decision.remade is None or slot != self.slot or self.membership.epoch != decision.epoch:
            return {}
        if not _on_gloo_with_a_store():
            return {}
        return {
            role: KeptGroup(role, group, slots, self.made_in[role])
            for role, (group, slots) in self._own_groups().items()
            if role not in decision.remade
        }

    def group_states(self) -> dict[str, GroupState]:
        """By role, each of this worker's groups: the epoch it was made in and the collectives
        posted on it so far (the survivors of a failure keep a group only where these agree)."""
        gloo = _on_gloo_with_a_store()  # only gloo's are kept, and only where these agree
        return {
            role: (self.made_in[role], group._get_sequence_number_for_group() if gloo else 0)
            for role, (group, _) in self._own_groups().items()
        }

    def _own_groups(self) -> dict[str, tuple[object, tuple[int, ...]]]:
        pipeline, stage = self.worker
        own = {stage_role(stage): (self.stage_groups.get(stage), self.live_workers(stage))}
        if pipeline in self.pipe_groups:
            own[pipe_role(pipeline)] = (
                self.pipe_groups[pipeline],
                [(pipeline, s) for s in range(self.pipe_parallel_size)],
            )
        return {
            role: (group, tuple(self.slot_of(w) for w in workers))
            for role, (group, workers) in own.items()
            if role in self.made_in
        }

    # ---- the logical topology ------------------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        return self.topo.get_dim("data")

    @property
    def pipe_parallel_size(self) -> int:
        return self.topo.get_dim("pipe")

    @property
    def model_parallel_size(self) -> int:
        return 1

    def worker_of(self, slot: int) -> Worker:
        coord = self.topo.get_coord(slot)
        return (coord.data, coord.pipe)

    def slot_of(self, worker: Worker) -> int:
        return self.topo.get_rank(pipe=worker[1], data=worker[0])

    @property
    def worker(self) -> Worker:
        return self.worker_of(self.slot)

    @property
    def failed(self) -> tuple[Worker, ...]:
        live = set(self.membership.members)
        return tuple(sorted(self.worker_of(s) for s in range(self.topo.world_size()) if s not in live))

    def is_live(self, worker: Worker) -> bool:
        return self.slot_of(worker) in self.membership.members

    def live_workers(self, stage: int) -> list[Worker]:
        return [(p, stage) for p in range(self.data_parallel_size) if self.is_live((p, stage))]

    def rank_of(self, worker: Worker) -> int:
        """The torch rank of a live worker in this epoch's world."""
        slot = self.slot_of(worker)
        if slot not in self.membership.members:
            raise LookupError(f"worker {worker} (slot {slot}) is not a member of epoch {self.membership.epoch}")
        return self.membership.members.index(slot)

    def partner(self, pipeline: int, stage: int) -> Worker:
        """The live worker of ``stage`` that stands in for pipeline ``pipeline`` in the per-pipeline
        exchanges (loss, partial norms, tied weights): the worker itself when live, else the next
        live pipeline at that stage, cyclically, which spreads the dead workers' partners."""
        D = self.data_parallel_size
        for step in range(D):
            worker = ((pipeline + step) % D, stage)
            if self.is_live(worker):
                return worker
        raise LookupError(f"stage {stage} has no live worker in epoch {self.membership.epoch}")

    def served_by(self, worker: Worker) -> list[int]:
        """The pipelines whose partner at ``worker``'s stage is ``worker``."""
        return [q for q in range(self.data_parallel_size) if self.partner(q, worker[1]) == worker]

    # ---- DeepSpeed's grid API -------------------------------------------------------------

    @property
    def data_parallel_id(self) -> int:
        return self.worker[0]

    def get_data_parallel_id(self) -> int:
        return self.worker[0]

    def get_stage_id(self) -> int:
        return self.worker[1]

    def get_global_rank(self) -> int:
        return self.rank_of(self.worker)

    def get_data_parallel_group(self):
        return self.stage_groups[self.worker[1]]

    def get_data_parallel_rank(self) -> int:
        return self.worker[0]

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_pipe_parallel_group(self):
        pipeline = self.worker[0]
        if pipeline not in self.pipe_groups:
            raise RuntimeError(
                f"pipeline {pipeline} is missing workers {[w for w in self.failed if w[0] == pipeline]} in epoch "
                f"{self.membership.epoch}: it has no pipe group (only whole pipelines do)"
            )
        return self.pipe_groups[pipeline]

    def get_pipe_parallel_rank(self) -> int:
        return self.worker[1]

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_slice_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_world_size(self) -> int:
        return 1

    @property
    def pp_group(self) -> list[int]:
        pipeline = self.worker[0]
        return [self.rank_of((pipeline, s)) for s in range(self.pipe_parallel_size) if self.is_live((pipeline, s))]

    @property
    def dp_group(self) -> list[int]:
        return [self.rank_of(w) for w in self.live_workers(self.worker[1])]

    def stage_to_global(self, stage_id: int, data: int | None = None, **kwargs) -> int:
        return self.rank_of((self.worker[0] if data is None else data, stage_id))

    def topology(self):
        return self.topo
