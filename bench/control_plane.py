"""The control plane at scale: emulated ranks that speak the real protocol against a real TCPStore.

For each store (``--store``: c10d, a TCPStore server; etcd, a 3-member etcd cluster on loopback
whose clients speak through etcd's grpc-gateway, the nodes' own stores still TCPStores) and each N
(G = 8 ranks per node), ``ds_recycle.testing.scale`` starts the job's store and the real
coordinator here, and emulated nodes (a real NodeLink, G real MembershipAgents and FailureWatchers,
iterations that sleep) in worker processes; every store client counts its operations. Per N:

- steady state: store operations per second (total, per node, the coordinator's share), over a
  window with no membership change, and the boundary decision latency (from the wall-clock boundary
  to the last member holding the decision) with the bytes each rank read for it;
- a process death (a rank of node 1 stops; its node's agent reports the exit as waitpid would):
  from the death to every survivor holding the recovery decision ("flag ms": to every survivor's
  failure watcher raising its flag, the detection's share), with the bytes each survivor read, its
  own store operations and those the death cost (then the same at 16,384 ranks, against the
  store's capacity with ``--capacity``);
- a node loss (node 2's agent and ranks stop at once): from the loss to every survivor holding the
  decision (the lease timeout plus the protocol's part);
- healthy ranks declared failed (a saturated store delays heartbeats and leases).

A death's "ops/rank" are a survivor's store operations (its recovery's and, "+watch", its failure
watcher's, which go to its node's store: ``ds_recycle.runtime.node.node_watch``); "store ops" is what
reached the job's store from every client between the death and the last survivor's decision, less
the steady load over that time (and, on a comment line, by kind, with the nodes' stores' apart).

- with ``--capacity``, first: the store server's saturation point (2 processes x 32 clients sending
  small operations back to back), with the libuv backend and the classic one;
- with ``--fan-out NODES ...``, first: the store's side of one decision made per node, which the
  runtime does not do yet (``ds_recycle.testing.fanout``): each node's client posts one record and
  counts it, the last one fixes the decision, every node reads it; from the alert to each node
  holding it (16,384 ranks = 2,048 nodes);
- with ``--rebuild P:D ...``, first: the cost of one epoch's process groups on P x D real gloo ranks
  (``ds_recycle.testing.rebuild``): one rank ends, the others build the next world, connect it and
  run a stage all-reduce, as a recovery does; every store operation (gloo's own included) is
  counted. Each grid four times: the pairs the plans use, one two-rank group each, and the stage
  and pipe groups, all kept from the epoch before unless the lost worker is theirs, as the runtime
  does ("groups"); the pairs kept and every stage and pipe group made afresh, as the runtime did in
  session 39 ("kept"); the same pairs made afresh in each epoch, as it did until session 39
  ("pairs"); every pair by one all-to-all, as it did until session 33 ("all"). Then the same
  arithmetic at 16,384 ranks, against the store's capacity.

    python bench/control_plane.py [--ranks 256 1024 4096 16384] [--store c10d etcd] [--workers 8]
        [--window 5] [--capacity] [--rebuild 4:2 4:4 4:8 4:16 2:16 8:4] [--fan-out 256 2048] [--smoke]

The last line, per store (on etcd: ``... ranks on etcd: ...``): ``control plane at N ranks: process
death -> X ms, node loss -> Y ms, steady load Z ops/s per node`` for the largest N run. The
capacity (``--capacity``) is the TCPStore server's: the etcd rows are not set against it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

from ds_recycle.testing.etcd_cluster import etcd_binary
from ds_recycle.testing.fanout import measure_fan_out
from ds_recycle.testing.rebuild import CONNECTS, RebuildCost, measure_rebuild
from ds_recycle.testing.scale import STORES, Harness, Shape, count_store_operations, store_capacity

PER_NODE = 8
AT_SCALE = 16384
"""The job size the issue sets: the measured per-rank costs are carried to it."""


KINDS = ("get", "set", "add", "compare_set", "check", "wait", "multi_get", "multi_set", "delete_key")


def _ops(before, after, seconds: float) -> float:
    return sum(after[k] - before[k] for k in KINDS) / seconds


def _latencies(records, kind: str, epoch: int, since: float) -> list[float]:
    return sorted(r[4] - since for r in records if r[0] == kind and r[2] == epoch)


def _collect(
    harness: Harness, kind: str, epoch: int, count: int, timeout: float, taken: list[tuple] | None = None
) -> tuple[list[tuple], collections.Counter, float]:
    """Reports until ``count`` ranks recorded ``kind`` for ``epoch`` (or the timeout), counting the
    records already ``taken`` (each report hands a record over once); with the store operations
    made so far (every client's) and when the last report came."""
    taken = list(taken or [])
    deadline = time.monotonic() + timeout
    ops, at = collections.Counter(), time.monotonic()
    while sum(1 for r in taken if r[0] == kind and r[2] == epoch) < count and time.monotonic() < deadline:
        time.sleep(0.25)
        coordinator, nodes, records = harness.report()
        taken.extend(records)
        ops, at = coordinator + nodes, time.monotonic()
    return taken, ops, at


def run(ranks: int, workers: int, window: float, iteration: float, lease: float, store: str = "c10d") -> dict:
    shape = Shape(ranks // PER_NODE, PER_NODE, iteration, lease)
    began = time.monotonic()
    harness = Harness(shape, workers=min(workers, shape.nodes), store=store)
    row = {"store": store, "ranks": ranks, "nodes": shape.nodes, "start_s": time.monotonic() - began}
    label = f"{store} {ranks} ranks"
    try:
        time.sleep(max(2.0, 2 * iteration))
        coordinator0, nodes0, _ = harness.report()
        t0 = time.monotonic()
        time.sleep(window)
        coordinator1, nodes1, records = harness.report()
        seconds = time.monotonic() - t0
        total = _ops(nodes0, nodes1, seconds) + _ops(coordinator0, coordinator1, seconds)
        row["ops_per_s"] = total
        row["ops_per_s_per_node"] = total / shape.nodes
        row["coordinator_ops_per_s"] = _ops(coordinator0, coordinator1, seconds)
        row["bytes_read_per_s"] = (nodes1["bytes_read"] - nodes0["bytes_read"]) / seconds
        boundaries: dict[float, list[tuple]] = {}  # by the boundary's wall time: the same on every rank
        for r in records:
            if r[0] == "boundary":
                boundaries.setdefault(round(r[3], 3), []).append(r)
        whole = [rs for rs in boundaries.values() if len(rs) == ranks]
        latest = [max(r[4] - r[3] for r in rs) for rs in whole]
        row["boundaries_complete"] = f"{len(whole)}/{len(boundaries)}"
        row["boundary_ms"] = (1000 * statistics.median(latest), 1000 * max(latest)) if latest else None
        row["boundary_bytes_per_rank"] = statistics.mean(r[5] for r in records if r[0] == "boundary") if records else 0

        coordinator2, nodes2, _ = harness.report()
        before, since = coordinator2 + nodes2, time.monotonic()
        harness.command(1, "kill_rank", PER_NODE + 1)
        survivors = ranks - 1
        records, after, until = _collect(harness, "recovered", 1, survivors, timeout=120.0)
        # Every client's operations from the death to the last survivor's decision, less the steady
        # load over that time: what the death cost the store.
        row["death_store_ops"] = _ops(before, after, 1.0) - total * (until - since)
        kinds = {k: after[k] - before[k] for k in KINDS if after[k] - before[k]}
        local = {k[5:]: after[k] - before[k] for k in sorted(after) if k.startswith("node ") and after[k] - before[k]}
        local.pop("bytes_read", None)
        print(f"#   {label}: a death's store ops by kind (steady load included): {kinds}; nodes' stores: {local}")
        killed = next(r[4] for r in records if r[0] == "killed")
        death = _latencies(records, "recovered", 1, killed)
        row["death_ms"] = (1000 * statistics.median(death), 1000 * death[-1], len(death)) if death else None
        flagged = sorted(r[3] - killed for r in records if r[0] == "recovered" and r[2] == 1 and r[3])
        row["flag_ms"] = (1000 * statistics.median(flagged), 1000 * flagged[-1]) if flagged else None
        recovered = [r for r in records if r[0] == "recovered"]
        row["death_bytes_per_rank"] = statistics.mean(r[5] for r in recovered) if recovered else 0
        row["death_ops_per_rank"] = statistics.mean(r[6] for r in recovered) if recovered else 0
        row["death_watcher_ops_per_rank"] = statistics.mean(r[7] for r in recovered) if recovered else 0
        _collect(harness, "entered", 1, survivors, timeout=60.0, taken=records)

        harness.command(2, "kill_node", 2)
        survivors -= PER_NODE
        records, _, _ = _collect(harness, "recovered", 2, survivors, timeout=120.0 + lease)
        lost = next(r[4] for r in records if r[0] == "killed_node")
        node = _latencies(records, "recovered", 2, lost)
        row["node_ms"] = (1000 * statistics.median(node), 1000 * node[-1], len(node)) if node else None
        lost_slots = {PER_NODE + 1, *range(2 * PER_NODE, 3 * PER_NODE)}
        failed = {c.slot for c in harness.coordinator.pending() if c.kind == "failed"}
        row["declared_hung"] = len(failed - lost_slots)
    except Exception:
        failed = [c for c in harness.coordinator.pending() if c.kind == "failed"]
        row["declared_hung"] = len(failed)
        raise
    finally:
        for change in [c for c in harness.coordinator.pending() if c.kind == "failed"][:3]:
            print(f"#   {label}: failed slot {change.slot}: {change.detail}", flush=True)
        for error in harness.errors[:3]:
            print(f"#   {label}: {len(harness.errors)} errors in emulated threads, e.g. {error[1]}: {error[5]}")
        harness.close()
    return row


def _fmt(pair) -> str:
    if pair is None:
        return "-"
    text = f"{pair[0]:.0f} / {pair[1]:.0f}"
    return text + (f" ({pair[2]})" if len(pair) > 2 else "")


def _grid(text: str) -> tuple[int, int]:
    pp, sep, dp = text.partition(":")
    if not sep or not pp.isdigit() or not dp.isdigit() or int(pp) < 1 or int(dp) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected P:D with P >= 1 and D >= 2, e.g. 4:8")
    return int(pp), int(dp)


def rebuild_rows(grids: list[tuple[int, int]], capacity: float | None, connects: tuple[str, ...] = CONNECTS) -> None:
    """One epoch's groups on real gloo ranks, made and connected as the runtime does (the plans'
    pairs and the groups without the lost worker kept) and, for comparison, as it did before (the
    pairs kept, every group made afresh; the pairs made afresh too; all to all); then the same
    per-rank costs at 16,384 ranks."""
    header = f"{'P x D':>7} {'ranks':>5} {'connect':>7} {'ops/rank':>8} {'max':>5} {'total ops':>9} {'slowest ms':>10}"
    print(f"{header}  by kind (all survivors)")
    costs: dict[str, list[RebuildCost]] = {connect: [] for connect in connects}
    for pp, dp in grids:
        for connect in connects:
            cost = measure_rebuild(pp, dp, connect)
            costs[connect].append(cost)
            kinds = " ".join(f"{k} {v}" for k, v in cost.by_kind.items())
            print(
                f"{f'{pp} x {dp}':>7} {cost.ranks:>5} {connect:>7} {cost.ops_per_rank:>8.1f} {cost.ops_max:>5} "
                f"{cost.total_ops:>9} {cost.seconds_max * 1e3:>10.0f}  {kinds}",
                flush=True,
            )
    at = AT_SCALE
    for connect, rows in costs.items():
        if len({c.ranks for c in rows}) < 2:
            continue
        if connect == "all":  # each rank reads every peer's address: linear in the world's size
            slope, intercept = statistics.linear_regression([c.ranks - 1 for c in rows], [c.ops_per_rank for c in rows])
            total = at * (slope * (at - 1) + intercept)
            line = f"rebuild ({connect}) per rank ~ {slope:.2f} x (N - 1) + {intercept:.1f} store ops"
        else:  # a rank's own peers only: flat in N (the lost worker's neighbours add O(D) to a few ranks)
            largest = max(rows, key=lambda c: c.ranks)
            total = at * largest.ops_per_rank
            line = f"rebuild ({connect}) per rank ~ {largest.ops_per_rank:.1f} store ops at {largest.ranks} ranks, flat"
        line += f"; at {at} ranks: {total:.3g} per epoch"
        if capacity:
            line += f", {total / capacity:.1f} s of the store at {capacity:.0f} ops/s"
        print(line, flush=True)


def fan_out_rows(node_counts: list[int], workers: int) -> None:
    print("the store's side of a decision made per node (one record per node, one read of the decision):")
    print(f"{'nodes':>6} {'ranks':>6} {'held ms median / max':>22} {'ops/node':>8} {'ops':>7}")
    for nodes in node_counts:
        cost = measure_fan_out(nodes, workers)
        print(
            f"{nodes:>6} {nodes * PER_NODE:>6} {cost.median_ms:>10.0f} / {cost.max_ms:<9.0f} "
            f"{cost.ops_per_node:>8.1f} {cost.ops_per_node * nodes:>7.0f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument(
        "--store",
        nargs="+",
        choices=STORES,
        default=["c10d"],
        help="the job's store: c10d (a TCPStore server) and/or etcd (3 members on loopback)",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--window", type=float, default=5.0, help="steady-state window, seconds")
    parser.add_argument("--iteration", type=float, default=1.0, help="emulated iteration time, seconds")
    parser.add_argument("--lease", type=float, default=10.0, help="node lease timeout, seconds")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="N = 24 only, one worker, short window, two small grids rebuilt as now and all to all (the suite's run)",
    )
    parser.add_argument(
        "--capacity", action="store_true", help="first, the store server's saturation point, libuv and not"
    )
    parser.add_argument(
        "--rebuild",
        type=_grid,
        nargs="+",
        default=[],
        metavar="P:D",
        help="first, one epoch's process groups on P x D real gloo ranks",
    )
    parser.add_argument(
        "--fan-out",
        type=int,
        nargs="+",
        default=[],
        metavar="NODES",
        help="first, the store's side of one decision made per node (what the 0.5 s goal needs)",
    )
    args = parser.parse_args(argv)
    connects = CONNECTS
    if args.smoke:
        args.ranks, args.workers, args.window, args.rebuild, args.fan_out = [24], 1, 1.0, [(2, 2), (2, 3)], [16]
        connects = ("all", "groups")
    if any(n % PER_NODE or n < 3 * PER_NODE for n in args.ranks):
        parser.error(f"--ranks: each N must be a multiple of {PER_NODE}, at least {3 * PER_NODE}")
    capacity = None
    if args.capacity:
        for use_libuv in (True, False):
            rate = store_capacity(use_libuv)
            capacity = capacity or rate
            print(f"store capacity ({'libuv' if use_libuv else 'classic'} backend, 2 x 32 clients): {rate:.0f} ops/s")
    if args.rebuild:
        rebuild_rows(args.rebuild, capacity, connects)
    if args.fan_out:
        fan_out_rows(args.fan_out, args.workers)
    stores = list(dict.fromkeys(args.store))
    if "etcd" in stores:
        binary, why = etcd_binary()
        if binary is None:
            print(f"etcd: not run: {why}", flush=True)
            stores.remove("etcd")
    count_store_operations()
    print(
        f"{'store':>5} {'ranks':>6} {'nodes':>5} {'start s':>7} {'ops/s':>9} {'per node':>8} {'coord':>7} "
        f"{'boundary ms':>12} {'B/rank':>7} {'death ms (n)':>18} {'flag ms':>12} {'B/rank':>7} {'ops/rank':>8} "
        f"{'+watch':>6} {'store ops':>9} {'node loss ms (n)':>20} {'hung':>4}"
    )
    rows: dict[str, list[dict]] = {store: [] for store in stores}
    for store in stores:
        for n in args.ranks:
            try:
                row = run(n, args.workers, args.window, args.iteration, args.lease, store)
            except Exception as error:  # report how far it got, go on with the next N
                print(f"{store:>5} {n:>6} failed: {type(error).__name__}: {error}", flush=True)
                continue
            rows[store].append(row)
            print(
                f"{store:>5} {row['ranks']:>6} {row['nodes']:>5} {row['start_s']:>7.1f} {row['ops_per_s']:>9.0f} "
                f"{row['ops_per_s_per_node']:>8.0f} {row['coordinator_ops_per_s']:>7.0f} "
                f"{_fmt(row['boundary_ms']):>12} {row['boundary_bytes_per_rank']:>7.0f} {_fmt(row['death_ms']):>18} "
                f"{_fmt(row['flag_ms']):>12} {row['death_bytes_per_rank']:>7.0f} {row['death_ops_per_rank']:>8.1f} "
                f"{row['death_watcher_ops_per_rank']:>6.1f} {row['death_store_ops']:>9.0f} "
                f"{_fmt(row['node_ms']):>20} {row['declared_hung']:>4}",
                flush=True,
            )
    if not any(rows.values()):
        print("control plane: no N could be run")
        return 1
    for store, done in rows.items():
        if done:
            _last_lines(store, done[-1], capacity if store == "c10d" else None)
    return 0


def _last_lines(store: str, last: dict, capacity: float | None) -> None:
    """The summary of the largest N run on ``store`` (c10d's as before the etcd rows; ``capacity``
    is the TCPStore server's, None for etcd)."""
    on = "" if store == "c10d" else f" on {store}"
    per = last["death_store_ops"] / (last["ranks"] - 1)
    total = (AT_SCALE - 1) * per
    line = (
        f"a process death at {AT_SCALE} ranks{on}: {total:.3g} store ops to the decision ({per:.1f} per survivor at "
        f"{last['ranks']} ranks, every client's; a survivor's own: {last['death_ops_per_rank']:.1f} its "
        f"recovery's, {last['death_watcher_ops_per_rank']:.1f} its failure watcher's on its node's store)"
    )
    if capacity:
        line += f", {total / capacity:.2f} s of the store's thread at {capacity:.0f} ops/s"
    print(line)
    death = "-" if last["death_ms"] is None else f"{last['death_ms'][1]:.0f}"
    node = "-" if last["node_ms"] is None else f"{last['node_ms'][1]:.0f}"
    print(
        f"control plane at {last['ranks']} ranks{on}: process death -> decision {death} ms, node loss -> {node} ms, "
        f"steady load {last['ops_per_s_per_node']:.0f} ops/s per node",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
