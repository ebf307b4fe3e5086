"""Plans made ahead in a background thread: which failure sets, and that a failure's lookup is then a
cache hit with the very plan an on-demand planner run gives."""

from __future__ import annotations

import pytest

from ds_recycle.planner.cache import PlanCache
from ds_recycle.planner.plan import CostModel
from ds_recycle.planner.prefetch import PlanPrefetcher, next_failure_sets
from ds_recycle.planner.request import PlanRequest

D, P, M = 3, 2, 4
COSTS = CostModel((2.0, 3.0), (2.0, 3.0), (1.0, 1.5))


def request(failed=()) -> PlanRequest:
    return PlanRequest(D, P, M, failed, COSTS)


def test_the_next_failures_are_each_live_worker_then_each_node_never_a_whole_stage():
    assert list(next_failure_sets(request())) == [((p, s),) for s in range(P) for p in range(D)]
    after_one = list(next_failure_sets(request(failed=[(0, 1)])))
    assert after_one == [
        ((0, 0), (0, 1)),
        ((0, 1), (1, 0)),
        ((0, 1), (2, 0)),
        ((0, 1), (1, 1)),
        ((0, 1), (2, 1)),
    ]
    nodes = [((0, 0), (0, 1)), ((1, 0), (1, 1)), ((2, 0), (2, 1))]  # a pipeline per node
    with_nodes = list(next_failure_sets(request(failed=[(0, 1)]), nodes))
    assert with_nodes[-2:] == [((0, 1), (1, 0), (1, 1)), ((0, 1), (2, 0), (2, 1))]
    assert ((0, 0), (0, 1)) in with_nodes and with_nodes.count(((0, 0), (0, 1))) == 1  # node 0: its live worker
    stage_per_node = [((0, 1), (1, 1), (2, 1))]  # a node holding every replica of stage 1
    assert all(len(s) == 1 for s in next_failure_sets(request(), stage_per_node))


def test_a_prefetched_plan_is_a_hit_and_equals_the_plan_made_on_demand():
    cache = PlanCache()
    prefetcher = PlanPrefetcher(cache)
    prefetcher.request(request(failed=[(2, 0)]))
    assert prefetcher.wait_idle(60)
    planned = prefetcher.planned
    assert planned >= 2 and len(cache) == planned and not cache.relabelled  # canonical sets only, no copies
    for failed in next_failure_sets(request(failed=[(2, 0)])):
        hits = cache.hits
        plan = cache.get_or_plan(request(failed))
        assert cache.hits == hits + 1 and cache.misses == 0
        fresh = PlanCache().get_or_plan(request(failed))
        assert plan.iteration_time == fresh.iteration_time and plan.workers == fresh.workers


def test_a_newer_request_replaces_an_older_one():
    cache = PlanCache()
    prefetcher = PlanPrefetcher(cache)
    prefetcher.request(request())
    newer = PlanRequest(D, P, M, (), CostModel.uniform(P))
    prefetcher.request(newer)
    assert prefetcher.wait_idle(60)
    assert prefetcher.done is newer
    for failed in next_failure_sets(newer):
        assert cache.get(newer.with_failed(failed)) is not None


@pytest.mark.parametrize("failed", [[(0, 0), (1, 0)], [(0, 1), (1, 1)]])
def test_nothing_is_prefetched_that_would_empty_a_stage(failed):
    assert all(
        sum(1 for _, s in workers if s == stage) < D
        for workers in next_failure_sets(request(failed=failed))
        for stage in range(P)
    )
