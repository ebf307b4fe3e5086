"""The per-node fan-out measurement: real clients against a real TCPStore, every node holds the decision."""

from __future__ import annotations

import pytest

from ds_recycle.testing.fanout import measure_fan_out


@pytest.mark.multiprocess
def test_every_node_holds_the_decision_after_the_alert():
    cost = measure_fan_out(nodes=12, processes=2)
    assert cost.nodes == 12
    assert 0 < cost.median_ms <= cost.max_ms < 10_000
    # alert wait and read, post, count, decision wait and read; the last node reads every record instead of waiting
    assert cost.ops_per_node == pytest.approx((11 * 6 + 7) / 12)


@pytest.mark.parametrize("nodes,processes", [(1, 1), (4, 0)])
def test_bad_sizes_are_named(nodes, processes):
    with pytest.raises(
        ValueError, match=rf"nodes must be at least 2 and processes at least 1, got {nodes} and {processes}"
    ):
        measure_fan_out(nodes, processes)
