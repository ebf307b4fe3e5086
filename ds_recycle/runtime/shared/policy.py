"""The protocol's pure decisions over its records: which groups the next epoch remakes, which slots
a migration may fill, which moves are under way, which leavers a boundary takes out. No store."""

from __future__ import annotations

from collections.abc import Callable

from ds_recycle.runtime.shared.records import FAILED, LEAVE, MOVE, RETIRED, Change, Decision, GroupState, Progress


def retired_slots(changes: list[Change]) -> set[int]:
    """Slots a migration may fill: their last change is ``retired`` (their agent will not start
    them again) and no move fills them already. A move fills its target from its acceptance on,
    unless its mover fails before the move is decided (then it is void)."""
    last: dict[int, Change] = {}
    filled_at: dict[int, int] = {}
    moving: dict[int, int] = {}
    """Mover -> target, while the move may still be undecided."""
    for change in changes:
        last[change.slot] = change
        if change.kind == MOVE and change.target is not None:
            filled_at[change.target] = change.seq
            moving[change.slot] = change.target
        elif change.slot in moving:
            target = moving.pop(change.slot)
            if change.kind == FAILED:
                filled_at.pop(target, None)
    return {slot for slot, change in last.items() if change.kind == RETIRED and filled_at.get(slot, -1) < change.seq}


def moves_under_way(changes: list[Change], members: tuple[int, ...]) -> dict[int, int]:
    """Mover -> target of the accepted moves whose mover is still a member (not yet decided)."""
    last: dict[int, Change] = {}
    for change in changes:
        last[change.slot] = change
    return {slot: c.target for slot, c in last.items() if c.kind == MOVE and slot in members and c.target is not None}


GroupRoles = Callable[[int], tuple[str, ...]]
"""The roles of a slot's groups (its stage's and its pipeline's): the group of a role has the
role's live slots as members."""


def groups_to_remake(
    changed: set[int],
    roles_of: GroupRoles | None,
    epoch: int | None = None,
    posts: dict[int, Progress] | None = None,
    members: tuple[int, ...] = (),
) -> tuple[str, ...] | None:
    """The roles whose groups the next epoch makes afresh; every other role's group is kept (None:
    every group is made afresh, when the decider knows no roles).

    A role is remade when one of its slots ``changed`` (left, failed or joined). After a failure
    (``posts``: every survivor's progress in ``epoch``, by slot) also when its survivors do not all
    hold the same group with the same number of collectives posted on it: a collective that some
    members posted and others never will is stuck on the group for good, and a later one would meet
    it. A survivor that holds the grid of another epoch than ``epoch`` (a failure stopped it while
    it entered one), and a member of the next epoch that posted nothing (``members``: a joiner),
    have every role of their slots remade."""
    if roles_of is None:
        return None
    remade = {role for slot in changed for role in roles_of(slot)}
    if posts is not None:
        remade.update(role for slot in members if slot not in posts for role in roles_of(slot))
    held: dict[str, set[GroupState]] = {}
    for slot, post in (posts or {}).items():
        if post.grid_epoch != epoch:
            remade.update(roles_of(slot))
        for role, state in post.groups.items():
            held.setdefault(role, set()).add(state)
    remade |= {role for role, states in held.items() if len(states) > 1}
    return tuple(sorted(remade))


def boundary_leavers(decision: Decision) -> set[int]:
    """The leavers a boundary decision takes out, alive then (not failed in it)."""
    failed = {c.slot for c in decision.changes if c.kind == FAILED}
    return {c.slot for c in decision.changes if c.kind == LEAVE and c.slot not in failed}
