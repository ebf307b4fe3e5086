"""The pairs the rebuild bench connects when only a plan's pairs are connected."""

from __future__ import annotations

import pytest

from ds_recycle.testing.rebuild import measure_rebuild, plan_peers


@pytest.mark.parametrize("pp,dp", [(2, 2), (3, 3), (4, 8), (8, 4)])
def test_plan_peers_are_symmetric_and_leave_out_the_lost_worker(pp, dp):
    victim = pp * dp - 1
    peers = {s: plan_peers(s, pp, dp, victim) for s in range(pp * dp - 1)}
    for slot, others in peers.items():
        assert victim not in others and slot not in others
        for other in others:
            assert slot in peers[other], (slot, other)
    # a pipeline's middle stage talks to both neighbours; the lost worker's neighbour also to its replicas
    lost_pipeline, lost_stage = victim % dp, victim // dp
    neighbour = (lost_stage - 1) * dp + lost_pipeline
    assert len(peers[neighbour]) == (1 if lost_stage - 1 > 0 else 0) + dp - 1
    assert all(len(others) <= 2 + dp - 1 for others in peers.values())


def test_an_unknown_connect_mode_is_named():
    with pytest.raises(ValueError, match=r"connect must be one of \('all', 'plan'\), got 'some'"):
        measure_rebuild(2, 2, "some")
