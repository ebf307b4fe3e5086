"""What a node's loss does to the grid: pipeline-major against DeepSpeed's stage-major numbering."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_recycle.runtime.shared.placement import contiguous_nodes, emptied_stages, unsafe_nodes


def stage_major(P: int, D: int) -> dict[int, tuple[int, int]]:
    """DeepSpeed's PipeDataParallelTopology: rank = stage * D + pipeline."""
    return {s * D + p: (p, s) for s in range(P) for p in range(D)}


def pipeline_major(P: int, D: int) -> dict[int, tuple[int, int]]:
    """ProcessTopology(axes=['data', 'pipe']): rank = pipeline * P + stage."""
    return {p * P + s: (p, s) for p in range(D) for s in range(P)}


grids = st.tuples(st.integers(1, 8), st.integers(2, 8), st.integers(1, 8)).filter(lambda t: (t[0] * t[1]) % t[2] == 0)


@given(grids)
def test_pipeline_major_survives_any_one_node_when_a_node_holds_at_most_a_pipeline(grid):
    P, D, G = grid
    nodes = contiguous_nodes(P * D, G)
    layout = pipeline_major(P, D)
    if G <= P:
        assert not unsafe_nodes(nodes, layout, P)


@given(grids)
def test_stage_major_loses_a_stage_with_one_node_when_a_node_holds_every_replica(grid):
    P, D, G = grid
    nodes = contiguous_nodes(P * D, G)
    layout = stage_major(P, D)
    if G >= D and G % D == 0:
        unsafe = unsafe_nodes(nodes, layout, P)
        assert set(unsafe) == set(nodes)
        assert sorted(s for stages in unsafe.values() for s in stages) == list(range(P))


@given(grids, st.data())
def test_losing_more_nodes_never_brings_a_stage_back(grid, data):
    P, D, G = grid
    nodes = contiguous_nodes(P * D, G)
    layout = data.draw(st.sampled_from([stage_major(P, D), pipeline_major(P, D)]))
    order = data.draw(st.permutations(sorted(nodes)))
    emptied: set[int] = set()
    for k in range(len(order) + 1):
        now = set(emptied_stages(nodes, layout, P, order[:k]))
        assert emptied <= now
        emptied = now
    assert emptied == set(range(P)), "every stage is empty once every node is gone"


def test_a_node_holding_both_replicas_of_a_stage_is_named():
    nodes = contiguous_nodes(8, 2)  # 4 nodes of 2
    assert unsafe_nodes(nodes, stage_major(4, 2), 4) == {0: [0], 1: [1], 2: [2], 3: [3]}
    assert unsafe_nodes(nodes, pipeline_major(4, 2), 4) == {}


def test_nodes_with_one_domain_label_fail_together():
    from ds_recycle.runtime.shared.placement import domains_of, unsafe_nodes

    nodes = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    worker_of = {rank: (rank % 3, rank // 3) for rank in range(6)}  # stage-major, P = 2, D = 3
    assert unsafe_nodes(nodes, worker_of, 2) == {}
    racks = domains_of(nodes, {0: "rackA", 1: "rackA", 2: ""})
    assert racks == {"rackA": [0, 1, 2, 3], "node 2": [4, 5]}
    assert unsafe_nodes(racks, worker_of, 2) == {"rackA": [0]}


def test_the_node_layout_of_a_rank_environment():
    from ds_recycle.runtime.shared.placement import NodeLayout

    layout = NodeLayout.from_env({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"})
    assert layout == NodeLayout(8, 2) and layout.several and layout.count == 4
    assert layout.nodes == contiguous_nodes(8, 2)
    assert layout.node_of(5) == 2 and list(layout.slots(2)) == [4, 5]
    assert NodeLayout.from_env({"LOCAL_WORLD_SIZE": "4"}, world=12) == NodeLayout(12, 4)
    for one_node in (
        {"WORLD_SIZE": "4"},
        {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": ""},
        {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
    ):
        layout = NodeLayout.from_env(one_node)
        assert layout == NodeLayout(4, 4) and not layout.several and layout.count == 1
    with pytest.raises(KeyError):
        NodeLayout.from_env({"WORLD_SIZE": "4"}, required=True)
    with pytest.raises(ValueError):
        NodeLayout.from_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "two"})
