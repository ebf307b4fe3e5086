"""The cost of one epoch's process groups, measured on real gloo ranks (issue: rebuild what failed,
not the world).

Every epoch builds a fresh world on its own store prefix and every subgroup of it
(:func:`~ds_recycle.runtime.groups.rebuild_world`, :meth:`RecycleGrid.build`), all connecting
lazily. Here P x D real processes, with no engine, build the world of epoch 1, one process ends, and
the others build epoch 2 without it as a recovery does, exchange one message with each peer a plan
makes them exchange with (their pipeline neighbours, and for the neighbours of the lost worker,
every replica that takes over its micro-batches), then run one all-reduce on their stage's group.
Every store operation of the world, gloo's own included, goes through :class:`CountedStore`, a
``torch.distributed.Store`` that counts what it passes to the job's TCPStore; the harness reports
the operations and wall time of epoch 2.

``connect`` says how the pairs connect:

- ``"plan"``: as the runtime does, at each pair's first message, through the engine's own
  :class:`~ds_recycle.engine.routing.PeerChannel`;
- ``"all"``: as the runtime did until it connected only the pairs it uses: one all-to-all over the
  world at the start of every epoch, which connects every pair, then the same messages.
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
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the engine's modules import DeepSpeed
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ds_recycle.engine.routing import GRAD_NORM, PeerChannel
    from ds_recycle.runtime.groups import RecycleGrid, rebuild_world

    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    root = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = CountedClones(root)
    topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    everyone, victim = tuple(range(pp * dp)), pp * dp - 1

    def build(membership: Membership, connect: str) -> None:
        rebuild_world(store, membership, slot, TIMEOUT_SECONDS)
        if connect == "all":
            size = dist.get_world_size()
            dist.all_to_all_single(torch.empty(size), torch.zeros(size))
        grid = RecycleGrid.build(topo, membership, slot, TIMEOUT_SECONDS)
        channel = PeerChannel(grid, torch.device("cpu"))
        peers = [grid.worker_of(p) for p in plan_peers(slot, pp, dp, victim)] if membership.epoch > 1 else []
        for peer in peers:
            channel.send((torch.ones(1),), peer, GRAD_NORM, 0, 0)
        for peer in peers:
            channel.recv_into((torch.empty(1),), peer, GRAD_NORM, 0, 0)
        channel.wait_sends()
        dist.all_reduce(torch.ones(1), group=grid.stage_groups[grid.worker[1]])

    build(Membership(1, everyone, 0), connect)
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
    each pair a plan uses at its first message (the runtime) or every pair at the epoch's start
    (the runtime before it; see the module doc)."""
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
