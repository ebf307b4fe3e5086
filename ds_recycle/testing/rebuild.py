"""The cost of one epoch's process groups, measured on real gloo ranks (issue: rebuild what failed,
not the world).

Every epoch builds a fresh world on its own store prefix and every subgroup of it
(:func:`~ds_recycle.runtime.groups.rebuild_world`, :func:`~ds_recycle.runtime.groups.connect_all_pairs`,
:meth:`RecycleGrid.build`). Here P x D real processes, with no engine, build the world of epoch 1
and connect it, one process ends, and the others build epoch 2 without it exactly as a recovery
does, then run one all-reduce on their stage's group. Every store operation of the world, gloo's
own included, goes through :class:`CountedStore`, a ``torch.distributed.Store`` that counts what
it passes to the job's TCPStore; the harness reports the operations and wall time of epoch 2.

``connect="plan"`` measures, for comparison, what the runtime does not do yet: epoch 2's world
without the all-to-all that connects every pair, each survivor connecting only the peers a plan
makes it exchange with (its pipeline neighbours, and for the neighbour of the lost worker, every
replica that takes over the lost worker's micro-batches), one small send and receive per pair.
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

from ds_recycle.runtime.protocol import Membership
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


@dataclass
class CountedClones:
    """What :func:`rebuild_world` takes as the job store: it only clones it, for the world's own
    client. The clones are kept here: a Python store that only C++ still references has lost its
    methods (torch then raises "Not implemented")."""

    root: dist.Store
    made: list = field(default_factory=list)

    def clone(self) -> CountedStore:
        self.made.append(CountedStore(self.root.clone()))
        return self.made[-1]


CONNECTS = ("all", "plan")


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


def _barrier(store: dist.Store, name: str, count: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while int(store.add(name, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank arrived")
        time.sleep(0.01)


def plan_peers(slot: int, pp: int, dp: int, victim: int) -> list[int]:
    """The slots ``slot`` exchanges activations or gradients with once ``victim`` is gone (slot =
    stage * D + pipeline, DeepSpeed's pipe-data topology): its live pipeline neighbours; the
    victim's pipeline neighbours also talk to every live replica of the victim's stage."""
    pairs: set[frozenset[int]] = set()
    for pipeline in range(dp):
        for stage in range(pp - 1):
            pairs.add(frozenset((stage * dp + pipeline, (stage + 1) * dp + pipeline)))
    lost_pipeline, lost_stage = victim % dp, victim // dp
    for stage in (lost_stage - 1, lost_stage + 1):
        if 0 <= stage < pp:
            for pipeline in range(dp):
                if pipeline != lost_pipeline:
                    pairs.add(frozenset((stage * dp + lost_pipeline, lost_stage * dp + pipeline)))
    return sorted(other for pair in pairs if slot in pair and victim not in pair for other in pair - {slot})


def _rank(slot: int, pp: int, dp: int, port: int, connect: str, results: mp.Queue) -> None:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_recycle.runtime.groups import RecycleGrid, connect_all_pairs, rebuild_world

    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    root = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = CountedClones(root)
    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    everyone, victim = tuple(range(pp * dp)), pp * dp - 1

    def build(membership: Membership, connect: str) -> None:
        rebuild_world(store, membership, slot, TIMEOUT_SECONDS)
        if connect == "all":
            connect_all_pairs().wait()
        else:
            rank = membership.members.index
            ops = []
            for peer in plan_peers(slot, pp, dp, victim):
                ops += [dist.isend(torch.ones(1), rank(peer)), dist.irecv(torch.empty(1), rank(peer))]
            for op in ops:
                op.wait()
        grid = RecycleGrid.build(topo, membership, slot, TIMEOUT_SECONDS)
        dist.all_reduce(torch.ones(1), group=grid.stage_groups[grid.worker[1]])

    build(Membership(1, everyone, 0), "all")
    _barrier(root, "built/1", len(everyone))
    if slot == victim:
        _report(results, None)
    COUNTS.clear()
    began = time.monotonic()
    build(Membership(2, everyone[:-1], 1), connect)
    elapsed = time.monotonic() - began
    _barrier(root, "built/2", len(everyone) - 1)
    _report(results, (elapsed, {op: n for op, n in COUNTS.items() if op != "bytes_read"}))


def _report(results: mp.Queue, row: tuple | None) -> None:
    """Send ``row`` and end at once (the world's groups are never torn down, as in a rank)."""
    results.put(row)
    results.close()
    results.join_thread()
    os._exit(0)


def measure_rebuild(pp: int, dp: int, connect: str = "all") -> RebuildCost:
    """Epoch 2's store operations and time on P x D real gloo ranks, one of them gone; ``connect``:
    every pair (what the runtime does) or only the pairs a plan uses (see the module doc)."""
    if connect not in CONNECTS:
        raise ValueError(f"connect must be one of {CONNECTS}, got {connect!r}")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(s, pp, dp, server.port, connect, results)) for s in range(pp * dp)]
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
