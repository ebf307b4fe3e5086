"""The migration a rank proposes when a retired slot leaves the grid unbalanced.

A slot is *retired* when its agent will not start it again (``ds-recycle launch --rebalance
migrate``: it was given up past ``--max-restarts``, or a mover left it). After every decision
with changes, the lowest member looks for a move with the simulator's rule
(:func:`ds_recycle.planner.migration.next_move`): a survivor of a stage with workers to spare into
a retired slot of the stage furthest below its need, on the same node (its agent starts the
target on the mover's device). It proposes the move (a ``move`` request) only if the planner
predicts the new failure set's iteration at least :data:`MIN_GAIN` faster than the current one.
A retired slot is never respawned within this generation, so the gain lasts for the rest of the
job, and the move's own cost (the mover's leave, a process start and a state copy, a few seconds)
is paid once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ds_recycle.planner import migration
from ds_recycle.planner.plan import Worker

MIN_GAIN = 0.01
"""Smallest predicted relative gain of the iteration time worth a move (the simulator's default)."""


@dataclass(frozen=True)
class Proposal:
    mover: int
    """The slot that leaves."""
    target: int
    """The retired slot its device joins as."""
    move: migration.Move
    now: float
    """The planner's iteration time for the current failure set."""
    after: float
    """... and once the move is done."""

    def describe(self) -> str:
        return (
            f"move worker {self.move.source} (slot {self.mover}) into retired slot {self.target} "
            f"(worker {self.move.target}): predicted iteration {self.now:.1f} -> {self.after:.1f} "
            f"({1 - self.after / self.now:.1%} faster)"
        )


def propose(engine, retired: Collection[int], under_way: Mapping[int, int], ranks_per_node: int) -> Proposal | None:
    """The move worth making now, or None (see the module doc). ``under_way``: accepted moves not
    decided yet (mover slot -> target slot), counted as done; their movers do not move again."""
    grid = engine.grid
    D, P = grid.data_parallel_size, grid.pipe_parallel_size
    failed = set(grid.failed)
    for mover, target in under_way.items():
        failed = set(_moved(failed, migration.Move(grid.worker_of(mover), grid.worker_of(target))))
    costs = engine.plan.costs
    work = [costs.F[s] + costs.B[s] + costs.W[s] for s in range(P)]
    want = migration.needed(D, migration.live_per_stage(D, P, failed), work)
    now = engine.plans.predicted_time(tuple(sorted(failed))) if under_way else engine.plan.iteration_time
    for node in sorted({slot // ranks_per_node for slot in retired}):
        targets = {grid.worker_of(s) for s in retired if s // ranks_per_node == node}
        sources = {grid.worker_of(s) for s in grid.membership.members if s // ranks_per_node == node}
        sources -= failed
        move = migration.next_move(D, P, failed, want, work, targets=targets, sources=sources)
        if move is None:
            continue
        try:
            after = engine.plans.predicted_time(_moved(failed, move))
        except ValueError:  # the planner found no schedule for it (under a memory cap): not a candidate
            continue
        if after <= now * (1 - MIN_GAIN):
            return Proposal(grid.slot_of(move.source), grid.slot_of(move.target), move, now, after)
    return None


def _moved(failed: set[Worker], move: migration.Move) -> tuple[Worker, ...]:
    return tuple(sorted((failed - {move.target}) | {move.source}))
