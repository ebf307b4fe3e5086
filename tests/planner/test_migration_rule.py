"""The migration rule the simulator and the runtime share (planner/migration.py)."""

from __future__ import annotations

from ds_recycle.planner.migration import Move, migrate, needed, next_move


def test_the_rule_fills_the_stage_furthest_below_its_need_from_the_one_with_most_to_spare():
    # D=4, P=2, two workers of stage 1 dead: 4 and 2 live; equal work wants 3 and 3.
    dead = {(2, 1), (3, 1)}
    want = needed(4, [4, 2], [1.0, 1.0])
    assert want == [3, 3]
    # The mover leaves a pipeline with the most dead slots (pipeline 2, the lowest of the tie).
    assert next_move(4, 2, dead, want, [1.0, 1.0]) == Move((2, 0), (2, 1))
    assert migrate(4, 2, dead, [1.0, 1.0]) == ((Move((2, 0), (2, 1)),), ((2, 0), (3, 1)))


def test_targets_and_sources_restrict_the_move():
    dead = {(2, 1), (3, 1)}
    want = [3, 3]
    assert next_move(4, 2, dead, want, [1.0, 1.0], targets={(3, 1)}) == Move((2, 0), (3, 1))
    assert next_move(4, 2, dead, want, [1.0, 1.0], sources={(0, 0), (1, 0)}) == Move((0, 0), (2, 1))
    assert next_move(4, 2, dead, want, [1.0, 1.0], targets=set()) is None
    assert next_move(4, 2, dead, want, [1.0, 1.0], sources=set()) is None


def test_no_move_when_no_stage_can_spare_a_worker():
    # D=3, stage 1 down to 1, stage 0 down to 2: 3 workers, each stage needs at least 1.
    dead = {(1, 0), (1, 1), (2, 1)}
    assert needed(3, [2, 1], [1.0, 1.0]) == [1, 1]
    assert next_move(3, 2, dead, [1, 1], [1.0, 1.0]) is None


def test_a_heavier_stage_needs_more_workers():
    # The last stage twice as heavy: of 6 workers it wants 4.
    assert needed(4, [3, 3], [1.0, 2.0]) == [2, 4]
    # The mover comes from pipeline 3, which has a dead slot already: dead slots gather.
    assert next_move(4, 2, {(0, 0), (3, 1)}, [2, 4], [1.0, 2.0]) == Move((3, 0), (3, 1))
