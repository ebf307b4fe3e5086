"""The cost of one epoch's process groups, measured on real gloo ranks (issue: rebuild what failed,
not the world).

Every epoch builds a fresh world on its own store prefix and every subgroup of it
(:func:`~ds_recycle.runtime.groups.rebuild_world`, :func:`~ds_recycle.runtime.groups.connect_all_pairs`,
:meth:`RecycleGrid.build`). Here P x D real processes, with no engine, build the world of epoch 1
and connect it, one process ends, and the others build epoch 2 without it exactly as a recovery
does, then run one all-reduce on their stage's group. Every store operation of the world, gloo's
own included, goes through :class:`CountedStore`, a ``torch.distributed.Store`` that counts what
it passes to the job's TCPStore; the harness reports the operations and wall time of epoch 2.
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

TIMEOUT_SECONDS = 300.0


class CountedStore(dist.Store):
    """A store that counts every operation it passes on (gloo's C++ calls it too)."""

    def __init__(self, inner: dist.Store, counts: collections.Counter) -> None:
        super().__init__()
        self.inner, self.counts = inner, counts

    def set(self, key, value):
        self.counts["set"] += 1
        self.inner.set(key, value)

    def get(self, key):
        self.counts["get"] += 1
        return self.inner.get(key)

    def add(self, key, amount):
        self.counts["add"] += 1
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self.counts["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self.counts["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self.counts["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key):
        self.counts["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self):
        self.counts["num_keys"] += 1
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


@dataclass
class CountedClones:
    """What :func:`rebuild_world` takes as the job store: it only clones it, for the world's own
    client. The clones are kept here: a Python store that only C++ still references has lost its
    methods (torch then raises "Not implemented")."""

    root: dist.Store
    counts: collections.Counter
    made: list = field(default_factory=list)

    def clone(self) -> CountedStore:
        self.made.append(CountedStore(self.root.clone(), self.counts))
        return self.made[-1]


@dataclass(frozen=True)
class RebuildCost:
    pp: int
    dp: int
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


def _rank(slot: int, pp: int, dp: int, port: int, results: mp.Queue) -> None:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_recycle.runtime.groups import RecycleGrid, connect_all_pairs, rebuild_world

    counts: collections.Counter = collections.Counter()
    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    root = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = CountedClones(root, counts)
    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    everyone, victim = tuple(range(pp * dp)), pp * dp - 1

    def build(membership: Membership) -> None:
        rebuild_world(store, membership, slot, TIMEOUT_SECONDS)
        connect_all_pairs().wait()
        grid = RecycleGrid.build(topo, membership, slot, TIMEOUT_SECONDS)
        dist.all_reduce(torch.ones(1), group=grid.stage_groups[grid.worker[1]])

    build(Membership(1, everyone, 0))
    _barrier(root, "built/1", len(everyone))
    if slot == victim:
        _report(results, None)
    counts.clear()
    began = time.monotonic()
    build(Membership(2, everyone[:-1], 1))
    elapsed = time.monotonic() - began
    _barrier(root, "built/2", len(everyone) - 1)
    _report(results, (elapsed, dict(counts)))


def _report(results: mp.Queue, row: tuple | None) -> None:
    """Send ``row`` and end at once (the world's groups are never torn down, as in a rank)."""
    results.put(row)
    results.close()
    results.join_thread()
    os._exit(0)


def measure_rebuild(pp: int, dp: int) -> RebuildCost:
    """Epoch 2's store operations and time on P x D real gloo ranks, one of them gone."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(s, pp, dp, server.port, results)) for s in range(pp * dp)]
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
        pp, dp, statistics.mean(ops), max(ops), sum(ops), max(s for s, _ in survivors), dict(sorted(by_kind.items()))
    )
