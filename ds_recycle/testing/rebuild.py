"""The cost of one epoch's process groups, measured on real gloo ranks (issue: rebuild what failed,
not the world).

Every epoch builds a fresh world on its own store prefix and every subgroup of it
(:func:`~ds_recycle.runtime.rank.groups.rebuild_world`, :meth:`RecycleGrid.build`), and connects the
pairs its plan uses (:class:`~ds_recycle.runtime.rank.groups.PairLinks`). Here P x D real processes, with
no engine, build the world of epoch 1 and connect it, one process ends, and the others build epoch
2 without it exactly as a recovery does, then run one all-reduce on their stage's group. Every
store operation of the world, gloo's own included, goes through :class:`CountedStore`, a
``torch.distributed.Store`` that counts what it passes to the job's TCPStore; the harness reports
the operations and wall time of epoch 2.

``connect="groups"`` is the runtime: epoch 1 connects the peers of the fault-free plan, and each
survivor then connects the peers of epoch 2's plan (the heuristic's plan for the lost worker,
lowered: the workers its stream sends to or receives from, and those of the optimizer step,
:func:`~ds_recycle.engine.staggered_step.step_peers`), one two-rank group each, keeping the pairs
of epoch 1 whose peers survive; and it keeps the stage and pipe groups that do not contain the lost
worker (the decision remakes the others: :func:`~ds_recycle.runtime.shared.policy.groups_to_remake`).
``connect="kept"`` is what the runtime did in session 39: the pairs kept, every stage and pipe
group made afresh. ``connect="pairs"`` is what it did until session 39: the
same pairs, each epoch's made afresh. ``connect="all"`` is what it did until session 33: one
all-to-all over each world, which connects every pair.
"""

from __future__ import annotations

import collections
import datetime
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ds_recycle.runtime.shared.keys import world_prefix
from ds_recycle.runtime.shared.policy import groups_to_remake
from ds_recycle.runtime.shared.records import Decision, Membership
from ds_recycle.runtime.shared.transport import serve
from ds_recycle.testing import spawn_context
from ds_recycle.testing.scale import COUNTS, CountingStore

TIMEOUT_SECONDS = 300.0


class CountedStore(CountingStore, dist.Store):
    """The scale harness's counting client as a ``torch.distributed.Store``, so that gloo's C++
    calls go through it too (counted into :data:`~ds_recycle.testing.scale.COUNTS`)."""

    def __init__(self, inner: dist.Store) -> None:
        dist.Store.__init__(self)
        CountingStore.__init__(self, inner)

    def num_keys(self) -> int:
        value = self._store.num_keys()
        self._count("num_keys")
        return value

    def set_timeout(self, timeout) -> None:
        self._store.set_timeout(timeout)

    def clone(self) -> CountedStore:
        """Another counted connection (a stage or pipe group's own), kept alive with the clones."""
        _CLONES.append(CountedStore(self._store.clone()))
        return _CLONES[-1]


_CLONES: list[CountedStore] = []
"""Every clone a group made: a Python store that only C++ still references has lost its methods."""


@dataclass
class CountedClones:
    """What :func:`rebuild_world` takes of the job store: the world's own client
    (:meth:`~ds_recycle.runtime.shared.job_store.JobStore.world_rendezvous`), here a counted clone. The
    clones are kept here: a Python store that only C++ still references has lost its methods
    (torch then raises "Not implemented")."""

    root: dist.Store
    made: list = field(default_factory=list)

    def world_rendezvous(self, epoch: int) -> dist.Store:
        self.made.append(CountedStore(self.root.clone()))
        return dist.PrefixStore(world_prefix(epoch), self.made[-1])


CONNECTS = ("all", "pairs", "kept", "groups")
MICRO_BATCHES_PER_STAGE = 2


@dataclass(frozen=True)
class RebuildCost:
    pp: int
    dp: int
    connect: str
    ops_per_rank: float
    """Mean store operations per surviving rank to build and connect epoch 2."""
    ops_max: int
    total_ops: int
    seconds_max: float
    """The slowest survivor: from the start of its rebuild to its stage all-reduce done."""
    by_kind: dict[str, int]

    @property
    def ranks(self) -> int:
        return self.pp * self.dp


def store_barrier(store: dist.Store, name: str, count: int) -> None:
    """Until ``count`` processes added themselves to the store's counter ``name``."""
    store.add(name, 1)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while int(store.add(name, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank arrived")
        time.sleep(0.01)


def plan_peers(pp: int, dp: int, victim: int | None) -> dict[int, list[int]]:
    """By surviving slot (slot = stage * D + pipeline, DeepSpeed's pipe-data topology): the slots
    it exchanges messages with in the epoch without ``victim`` (None: with every slot), as the
    runtime connects them."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_recycle.engine.staggered_step import step_peers
    from ds_recycle.planner.heuristic import plan_heuristic
    from ds_recycle.planner.lowering import lower
    from ds_recycle.runtime.rank.groups import RecycleGrid

    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    membership = Membership(2, tuple(s for s in range(pp * dp) if s != victim), 1)
    lost = [] if victim is None else [(victim % dp, victim // dp)]
    streams = lower(plan_heuristic(dp, pp, MICRO_BATCHES_PER_STAGE * pp, lost))
    peers = {}
    for slot in membership.members:
        grid = RecycleGrid(topo, membership, slot, TIMEOUT_SECONDS)
        workers = {a.peer for a in streams[grid.worker].actions if hasattr(a, "peer")} | step_peers(grid)
        peers[slot] = sorted(grid.slot_of(w) for w in workers)
    return peers


def _rank(
    slot: int, pp: int, dp: int, port: int, connect: str, peers: tuple[list[int], list[int]], results: mp.Queue
) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_recycle.runtime.rank.groups import RecycleGrid, group_roles, rebuild_world
    from ds_recycle.runtime.rank.waiting import Waiter

    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    root = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = CountedClones(root)
    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    everyone, victim = tuple(range(pp * dp)), pp * dp - 1

    def build(membership: Membership, peers: list[int], previous: RecycleGrid | None = None):
        kept, remade, links = {}, None, None
        if previous is not None:  # the epoch a recovery decided without the victim
            links = previous.links
            if connect == "groups":
                remade = groups_to_remake({victim}, group_roles(topo))  # every survivor's groups agree
                decision = Decision(previous.membership.epoch, 1, 1, (), membership, remade)
                kept = previous.keep(decision, slot)
        rebuild_world(store, membership, slot, TIMEOUT_SECONDS, kept.values())
        if connect == "all":
            size = dist.get_world_size()
            dist.all_to_all_single(torch.empty(size), torch.zeros(size))
        grid = RecycleGrid.build(topo, membership, slot, TIMEOUT_SECONDS, links, kept, remade)
        if connect != "all":
            grid.links.connect([membership.members.index(peer) for peer in peers], Waiter(), membership.iteration)
        dist.all_reduce(torch.ones(1), group=grid.stage_groups[grid.worker[1]])
        return grid

    grid = build(Membership(1, everyone, 0), peers[0])
    store_barrier(root, "built/1", len(everyone))
    if slot == victim:
        _report(results, None)
    COUNTS.clear()
    began = time.monotonic()
    build(Membership(2, everyone[:-1], 1), peers[1], grid if connect in ("kept", "groups") else None)
    elapsed = time.monotonic() - began
    store_barrier(root, "built/2", len(everyone) - 1)
    _report(results, (elapsed, {op: n for op, n in COUNTS.items() if op != "bytes_read"}))


def _report(results: mp.Queue, row: tuple | None) -> None:
    """Send ``row`` and end at once (the world's groups are never torn down, as in a rank)."""
    results.put(row)
    results.close()
    results.join_thread()
    os._exit(0)


def measure_rebuild(pp: int, dp: int, connect: str = "all") -> RebuildCost:
    """Epoch 2's store operations and time on P x D real gloo ranks, one of them gone; ``connect``:
    the pairs the plans use, kept (what the runtime does) or made afresh, or every pair (see the
    module doc)."""
    if connect not in CONNECTS:
        raise ValueError(f"connect must be one of {CONNECTS}, got {connect!r}")
    server = serve("127.0.0.1", 0)
    ctx = spawn_context()
    results: mp.Queue = ctx.Queue()
    victim = pp * dp - 1
    before, after = plan_peers(pp, dp, None), plan_peers(pp, dp, victim)
    procs = [
        ctx.Process(target=_rank, args=(s, pp, dp, server.port, connect, (before[s], after.get(s, [])), results))
        for s in range(pp * dp)
    ]
    for proc in procs:
        proc.start()
    try:
        rows = [results.get(timeout=TIMEOUT_SECONDS) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
    survivors = [row for row in rows if row is not None]
    ops = [sum(counts.values()) for _, counts in survivors]
    by_kind: collections.Counter = collections.Counter()
    for _, counts in survivors:
        by_kind.update(counts)
    return RebuildCost(
        pp,
        dp,
        connect,
        statistics.mean(ops),
        max(ops),
        sum(ops),
        max(s for s, _ in survivors),
        dict(sorted(by_kind.items())),
    )
