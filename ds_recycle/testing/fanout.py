"""The store's side of a decision made per node, measured: one TCPStore gathers one progress record
per node and hands every node the decision.

The control plane's goal at 16,384 ranks (a process death to every survivor holding the decision in
0.5 s) cannot be met with every rank at the store (bench/control_plane.py at 256 ranks: 17
operations per survivor, its recovery's and its failure watcher's, some 2.8 x 10^5 per decision).
It needs each node's agent to speak for its ranks: gather their progress over loopback, post one
record, read the decision once and hand it on. The runtime does not do that yet; this measures what
the store would take for it, with real clients against a real TCPStore server: ``nodes`` clients
(threads in worker processes) each block on the alert key; the harness sets it (as the coordinator
publishes a failure); each node posts its record and counts it; the node whose count completes them
reads every record and fixes the decision with one ``compare_set``; the others block on the
decision key and read it. Measured: from the alert's write to each node holding the decision, and
the store operations made.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from ds_recycle.runtime.shared.transport import serve
from ds_recycle.testing import spawn_context

TIMEOUT_SECONDS = 300.0
RECORD_BYTES = 8 * 48
"""A node's record: the progress of its 8 ranks (about 48 bytes each as the protocol writes them)."""
THREAD_STACK_BYTES = 256 * 1024


@dataclass(frozen=True)
class FanOut:
    nodes: int
    median_ms: float
    max_ms: float
    ops_per_node: float


def _node(node: int, nodes: int, port: int, samples: list) -> None:
    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
    store.add("ready", 1)
    store.wait(["alert"])
    alerted = float(store.get("alert"))
    store.set(f"progress/{node}", b"x" * RECORD_BYTES)
    ops = 4
    if int(store.add("count", 1)) == nodes:
        records = store.multi_get([f"progress/{k}" for k in range(nodes)])
        store.compare_set("decision", "", str(len(records)))
        ops += 2
    else:
        store.wait(["decision"])
        ops += 1
    store.get("decision")
    held = time.time()
    samples.append((held - alerted, ops + 1))


def _worker(first: int, count: int, nodes: int, port: int, results: mp.Queue) -> None:
    threading.stack_size(THREAD_STACK_BYTES)
    samples: list = []
    threads = [threading.Thread(target=_node, args=(k, nodes, port, samples)) for k in range(first, first + count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_SECONDS)
    results.put(samples)


def measure_fan_out(nodes: int, processes: int = 8) -> FanOut:
    """One decision over ``nodes`` nodes (see the module doc), their clients in ``processes`` processes."""
    if nodes < 2 or processes < 1:
        raise ValueError(f"nodes must be at least 2 and processes at least 1, got {nodes} and {processes}")
    server = serve("127.0.0.1", 0)
    ctx = spawn_context()
    results: mp.Queue = ctx.Queue()
    share = -(-nodes // processes)
    procs = [
        ctx.Process(target=_worker, args=(first, min(share, nodes - first), nodes, server.port, results))
        for first in range(0, nodes, share)
    ]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while int(server.add("ready", 0)) < nodes:
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"only {int(server.add('ready', 0))} of {nodes} nodes connected")
            time.sleep(0.05)
        time.sleep(0.5)  # every client is in its wait
        server.set("alert", repr(time.time()))
        samples = [sample for _ in procs for sample in results.get(timeout=TIMEOUT_SECONDS)]
    finally:
        for proc in procs:
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
    if len(samples) != nodes:
        raise RuntimeError(f"{len(samples)} of {nodes} nodes held the decision")
    times = [1000.0 * seconds for seconds, _ in samples]
    return FanOut(nodes, statistics.median(times), max(times), sum(ops for _, ops in samples) / nodes)
