"""A node's agent link (runtime/node.py) against a real TCPStore: it renews its lease, carries out
the coordinator's kill orders for its node, and fences the node when its renewals stop."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.coordinator import renew_seconds
from ds_recycle.runtime.node import NodeLink
from ds_recycle.runtime.protocol import KillOrder, Lease


def _wait(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_the_link_renews_its_lease_and_carries_out_its_nodes_kill_orders_only():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = dist.PrefixStore(proto.prefix(0), server)
    killed: list[tuple[int, int]] = []
    link = NodeLink(
        f"127.0.0.1:{server.port}",
        0,
        1,
        "t" * 32,
        2.0,
        log=lambda line: None,
        kill=lambda s, i: killed.append((s, i)),
        fence=lambda why: None,
    )
    assert link.register() == 1
    link.start()
    try:
        first = Lease.from_json(store.get(proto.lease_key(1))).time
        assert _wait(lambda: Lease.from_json(store.get(proto.lease_key(1))).time > first, 1.0), "lease not renewed"
        for node, slot, incarnation in ((1, 5, 2), (0, 1, 0), (1, 4, 0)):  # the coordinator's writes
            index = int(store.add(proto.kill_count_key(node), 1))
            store.set(proto.kill_key(node, index), KillOrder(slot, incarnation).to_json())
        # Taken at the lease's renewal period (0.1 s here), in order; node 0's order is not its own.
        assert _wait(lambda: len(killed) == 2, 4 * renew_seconds(2.0) + 1.0), killed
        assert killed == [(5, 2), (4, 0)]
    finally:
        link.stop()


def test_a_link_whose_renewals_stop_fences_its_node():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    fenced: list[str] = []
    link = NodeLink(
        f"127.0.0.1:{server.port}",
        0,
        2,
        "t" * 32,
        0.5,
        log=lambda line: None,
        kill=lambda s, i: None,
        fence=fenced.append,
    )
    link.register()
    link.last_renewal = time.time() - 1.0  # as after a freeze longer than the lease
    link.start()
    try:
        assert _wait(lambda: fenced, 2.0) and link.fenced
        assert "no lease renewal" in fenced[0]
    finally:
        link.stop()
