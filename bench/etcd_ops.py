"""Per-operation latency of the job store's transport: torch's TCPStore against EtcdStore on a
3-member etcd cluster on loopback (ds_recycle.testing.etcd_cluster; data on /dev/shm, so no disk
flush is counted: on real disks add an fdatasync, about 1 ms on an SSD, to every write).

Rows: set, get (an existing key), add (an existing counter), compare_set (a missing key, expected
empty: the decision's shape), check (3 keys), multi_get (8 keys), and wait wake-up (a waiter blocked
in ``wait`` on its own client, timed from the start of the writer's ``set`` to the waiter's return).
Each cell is the median and the 90th percentile over the repetitions, in microseconds; the client is
one Python thread, as a coordinator or an agent is.

    .venv/bin/python bench/etcd_ops.py [--reps 300] [--wakeups 40]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ds_recycle.runtime.shared.etcd_transport import EtcdConfig, EtcdStore
from ds_recycle.testing.etcd_cluster import start_cluster


def timed(op: Callable[[int], object], reps: int) -> list[float]:
    samples = []
    for i in range(reps):
        started = time.perf_counter()
        op(i)
        samples.append(time.perf_counter() - started)
    return samples


def wakeups(writer: dist.Store, waiter: dist.Store, reps: int, tag: str) -> list[float]:
    samples = []
    for i in range(reps):
        key = f"{tag}/wake/{i}"
        woke: list[float] = []

        def wait(key: str = key, woke: list[float] = woke) -> None:
            waiter.wait([key], timedelta(seconds=10))
            woke.append(time.perf_counter())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.02)  # the waiter is blocked in its wait
        started = time.perf_counter()
        writer.set(key, "1")
        thread.join(10)
        samples.append(woke[0] - started)
    return samples


def measure(writer: dist.Store, waiter: dist.Store, reps: int, wakes: int, tag: str) -> dict[str, list[float]]:
    writer.set(f"{tag}/get", "x" * 64)
    writer.add(f"{tag}/counter", 1)
    names = [f"{tag}/m{i}" for i in range(8)]
    writer.multi_set(names, ["v" * 64] * 8)
    for _ in range(20):  # warm the connections
        writer.get(f"{tag}/get")
    return {
        "set": timed(lambda i: writer.set(f"{tag}/set", "y" * 64), reps),
        "get": timed(lambda i: writer.get(f"{tag}/get"), reps),
        "add": timed(lambda i: writer.add(f"{tag}/counter", 1), reps),
        "compare_set": timed(lambda i: writer.compare_set(f"{tag}/cas/{i}", "", "decision" * 8), reps),
        "check (3 keys)": timed(lambda i: writer.check(names[:3]), reps),
        "multi_get (8 keys)": timed(lambda i: writer.multi_get(names), reps),
        "wait wake-up": wakeups(writer, waiter, wakes, tag),
    }


def cell(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{1e6 * statistics.median(ordered):8.0f} / {1e6 * p90:7.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300, help="repetitions of each operation")
    parser.add_argument("--wakeups", type=int, default=40, help="repetitions of the wait wake-up")
    parser.add_argument("--smoke", action="store_true", help="20 repetitions and 5 wake-ups (the suite's smoke run)")
    args = parser.parse_args()
    if args.smoke:
        args.reps, args.wakeups = 20, 5

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    tcp_waiter = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    tcp_rows = measure(tcp, tcp_waiter, args.reps, args.wakeups, "tcp")

    cluster = start_cluster(3)
    try:
        config = EtcdConfig(tuple(cluster.endpoints), "bench")
        etcd = EtcdStore(config, timeout=30)
        etcd_rows = measure(etcd, etcd.clone(), args.reps, args.wakeups, "etcd")
    finally:
        cluster.stop()

    print(f"per-operation latency, µs (median / p90); {args.reps} reps, {args.wakeups} wake-ups")
    print(f"{'operation':<20} {'TCPStore':>18} {'EtcdStore (3 members)':>24} {'ratio':>7}")
    for name in tcp_rows:
        ratio = statistics.median(etcd_rows[name]) / statistics.median(tcp_rows[name])
        print(f"{name:<20} {cell(tcp_rows[name]):>18} {cell(etcd_rows[name]):>24} {ratio:>6.0f}x")


if __name__ == "__main__":
    main()
