"""Hypothesis strategies shared by the planner tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def survivable_failures(draw, pipelines: int, stages: int, max_size: int) -> list[tuple[int, int]]:
    """Distinct failed workers, keeping at least one survivor in every stage."""
    workers = [(p, s) for p in range(pipelines) for s in range(stages)]
    drawn = draw(st.lists(st.sampled_from(workers), max_size=max_size, unique=True))
    per_stage: dict[int, int] = {}
    kept = []
    for p, s in drawn:
        if per_stage.get(s, 0) + 1 < pipelines:
            per_stage[s] = per_stage.get(s, 0) + 1
            kept.append((p, s))
    return kept
