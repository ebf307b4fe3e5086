"""The pairs the rebuild bench connects: those of the epoch's plan, as the runtime connects them."""

from __future__ import annotations

import pytest

from ds_recycle.testing.rebuild import measure_rebuild, plan_peers


@pytest.mark.parametrize("pp,dp", [(2, 2), (3, 3), (4, 8), (8, 4)])
def test_plan_peers_are_symmetric_and_leave_out_the_lost_worker(pp, dp):
    victim = pp * dp - 1
    peers = plan_peers(pp, dp, victim)
    assert sorted(peers) == list(range(pp * dp - 1))
    for slot, others in peers.items():
        assert victim not in others and slot not in others
        for other in others:
            assert slot in peers[other], (slot, other)
    # every worker talks to the rest of its pipeline (the step); the lost worker's replicas at most to D more
    for slot, others in peers.items():
        stage, pipeline = divmod(slot, dp)
        assert {s * dp + pipeline for s in range(pp) if s * dp + pipeline != victim} - {slot} <= set(others)
        assert len(others) <= 2 * (pp - 1) + 2 * dp


@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 8)])
def test_the_fault_free_plans_peers_are_symmetric_and_every_worker_has_some(pp, dp):
    peers = plan_peers(pp, dp, None)
    assert sorted(peers) == list(range(pp * dp))
    for slot, others in peers.items():
        assert others and slot not in others
        for other in others:
            assert slot in peers[other], (slot, other)


def test_an_unknown_connect_mode_is_named():
    with pytest.raises(ValueError, match=r"connect must be one of \('all', 'pairs', 'kept', 'groups'\), got 'some'"):
        measure_rebuild(2, 2, "some")
