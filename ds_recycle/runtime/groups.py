"""ReCycle's grid: the live workers of one epoch, their torch ranks, and their process groups.

DeepSpeed's ``PipelineParallelGrid`` needs ``world = P x D``; after a failure the world is smaller.
:class:`RecycleGrid` keeps the logical topology (every worker is a slot of the original P x D
grid), maps live slots to the ranks of the current world, and holds one data-parallel group per
stage among its live workers, plus a pipe group for every pipeline that is whole. It answers the
parts of DeepSpeed's grid API that the engine uses, so it replaces ``engine.grid`` and
``engine.mpu`` in place.

Every epoch gets a fresh world on its own store prefix (``world/<epoch>/``): the old default group
is destroyed and its groups are kept in a graveyard, never reused and never released from a thread
that might block on them (docs/design.md, "Process groups").

Every group ReCycle makes connects lazily (gloo's ``TORCH_GLOO_LAZY_INIT``): creating it publishes
this rank's address and returns, and a pair of ranks connects at its first op. An eager gloo group
waits in its constructor, a C++ store wait that nothing can interrupt, for every member's address:
a member that died after the epoch was entered held every survivor there for the group timeout.
Lazily, that wait happens inside an op. A collective runs in gloo's worker thread, which the rank
waits for against the failure flag (``runtime/waiting.py``). A p2p op does not: it connects its
pair in the calling thread and waits there (gloo's ``Pair::verifyConnected``) until the peer
connects too, so a rank's first send to a peer would wait for the peer to reach its own first op
on the pair: a rendezvous that an asynchronous send must not be, and a wait that a dead peer ends
only at the group timeout. So routed p2p runs on :class:`PairLinks`: one two-rank group per pair of
workers that exchange messages, connected by one one-element all-reduce (a collective) that both
ranks start at the same point of the program and wait for against the failure flag. A rank
connects only its peers, never the whole world: its store operations per epoch grow with its
peers, not with the world.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ds_recycle.planner.plan import Worker
from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.protocol import Membership

GROUP_TIMEOUT_SECONDS = 120.0
"""Every group's op timeout: a backstop only, failure detection does not wait for it."""


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


def rebuild_world(store, membership: Membership, slot: int, timeout: float = GROUP_TIMEOUT_SECONDS) -> None:
    """Leave the current world (if any) and join the world of ``membership`` on its own prefix.
    Returns at once: the world connects lazily.

    The world gets its own connection to the store (``store.clone()``): gloo looks up a peer's
    address in its own threads, and a lookup of a dead peer's address blocks its connection until
    the group timeout; on the caller's connection it would block the membership protocol too."""
    if dist.is_initialized():  # the previous epoch's, or a joiner's fake world
        bury(c10d._world.pg_map.keys())
        dist.destroy_process_group()
    global _leaving_at_exit
    if not _leaving_at_exit:
        _leaving_at_exit = True
        atexit.register(_leave_world_at_exit)
    with lazy_connections():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(proto.world_prefix(membership.epoch), store.clone()),
            rank=membership.members.index(slot),
            world_size=len(membership.members),
            timeout=datetime.timedelta(seconds=timeout),
        )


_leaving_at_exit = False


def _leave_world_at_exit() -> None:
    """At exit the last world is left as every earlier one was: buried and unregistered. torch's
    registry of groups is a C++ static, destroyed after the interpreter: a group still in it is
    destroyed there, and its destructor joins gloo's worker threads. One blocked in an op of a dead
    peer held a joiner that gave up its join in its exit for the group timeout (seen here); a rank that
    had finished training once ended by SIGABRT at exit, just after its peer's (CI, after a node's
    loss and re-admission)."""
    if dist.is_initialized():
        bury(c10d._world.pg_map.keys())
        dist.destroy_process_group()


PAIR_PREFIX = "pair"
"""The store prefix of a world's pair groups: ``<world's prefix>/pair/<k>/<lower rank>_<higher rank>/``,
for the k-th :class:`PairLinks` of that world (several engines can share one world)."""

_links_made: dict[int, int] = {}
"""By world (the default group's id): how many :class:`PairLinks` this process made on it."""


@dataclass
class PairLinks:
    """Routed p2p's transport in one world: a two-rank gloo group per peer this rank exchanges
    messages with (see the module doc). On a world that is not gloo's (NCCL connects its pairs
    itself; a joiner's placeholder world carries nothing) the messages go on the world group."""

    rank: int
    timeout: float
    store: object | None = None
    """The world's store; None: p2p on the world group."""
    groups: dict[int, object] = field(default_factory=dict)
    """By peer rank: the pair's group (created, perhaps not connected)."""
    connected: set[int] = field(default_factory=set)
    prefix: str = PAIR_PREFIX

    @classmethod
    def of_world(cls, timeout: float) -> PairLinks:
        """The links of the current world; every rank of it makes its k-th at the same point."""
        if dist.get_backend() != dist.Backend.GLOO:
            return cls(dist.get_rank(), timeout)
        world = id(c10d._get_default_group())
        made = _links_made.get(world, 0)
        _links_made[world] = made + 1
        return cls(dist.get_rank(), timeout, c10d._get_default_store(), prefix=f"{PAIR_PREFIX}/{made}")

    def connect(self, peers, waiter) -> None:
        """Connect this rank to every rank of ``peers`` it is not connected to yet. Each of them
        must call this with this rank among its ``peers`` at the same point of the program (the
        start of an iteration, or of a re-sync): the connection is a collective of the pair."""
        if self.store is None:
            return
        new = sorted(set(peers) - self.connected - {self.rank})
        # Every group first, then every connection: a group publishes its address on the world's
        # store client, which a connection's lookup of a peer's address holds until the peer
        # publishes its own (a dead one: until the timeout), so a group made after a connection
        # could wait there, in C++, beyond the failure flag.
        with lazy_connections():
            for peer in new:
                if peer not in self.groups:
                    self.groups[peer] = self._group(peer)
                    bury([self.groups[peer]])
        works = [(peer, self.groups[peer].allreduce([torch.zeros(1)])) for peer in new]
        for peer, work in works:
            waiter.collective(lambda work=work: work, f"connecting rank {self.rank} to rank {peer}")
            self.connected.add(peer)

    def _group(self, peer: int):
        low, high = sorted((self.rank, peer))
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self.timeout)
        options._threads = 1
        options._devices = _pair_devices()
        store = dist.PrefixStore(f"{self.prefix}/{low}_{high}/", self.store)
        return dist.ProcessGroupGloo(store, 0 if self.rank == low else 1, 2, options)

    def isend(self, tensor: torch.Tensor, dst: int):
        group = self._linked(dst)
        return dist.isend(tensor, dst=dst) if group is None else group.send([tensor], int(dst > self.rank), 0)

    def irecv(self, tensor: torch.Tensor, src: int):
        group = self._linked(src)
        return dist.irecv(tensor, src=src) if group is None else group.recv([tensor], int(src > self.rank), 0)

    def _linked(self, peer: int):
        if self.store is None:
            return None
        if peer not in self.connected:
            raise RuntimeError(
                f"routed p2p between ranks {self.rank} and {peer}: the pair was not connected (connected: "
                f"{sorted(self.connected)}); every pair a plan uses must be connected first (PeerChannel.connect)"
            )
        return self.groups[peer]


def _pair_devices() -> list:
    """A pair group's own gloo devices (lazily connecting groups on one device would share their
    sequence numbers), on the interfaces ``GLOO_SOCKET_IFNAME`` names, as torch picks them for a
    group it makes itself; else on the address the host's name resolves to."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:
        return [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True) for name in interfaces.split(",")]
    return [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]


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
    """Routed p2p's pair groups in this epoch's world."""

    @classmethod
    def build(cls, topo, membership: Membership, slot: int, timeout: float) -> RecycleGrid:
        """Create this epoch's groups; every member calls it in the same order."""
        grid = cls(topo, membership, slot, timeout)
        for stage in range(grid.pipe_parallel_size):
            ranks = [grid.rank_of(w) for w in grid.live_workers(stage)]
            grid.stage_groups[stage] = new_group(ranks, timeout)
        for pipeline in range(grid.data_parallel_size):
            stages = [(pipeline, s) for s in range(grid.pipe_parallel_size)]
            if all(grid.is_live(w) for w in stages):
                grid.pipe_groups[pipeline] = new_group([grid.rank_of(w) for w in stages], timeout)
        grid.links = PairLinks.of_world(timeout)
        return grid

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
