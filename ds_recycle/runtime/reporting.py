"""One line and one :class:`~ds_recycle.runtime.events.MembershipChange` per membership change.

The line follows DeepSpeed's log format and says, in one place: the epoch, who left, failed or
joined, the detection latency, the switch time, and the new plan against fault-free and its lower
bound. The engine hands the change to its monitors on the lowest live rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ds_recycle.log import logger
from ds_recycle.runtime.events import MembershipChange
from ds_recycle.runtime.protocol import FAILED, JOIN, LEAVE, Decision

KINDS = (LEAVE, FAILED, JOIN)


@dataclass(frozen=True)
class Before:
    """What a change is measured against, taken before the new epoch is entered."""

    members: tuple[int, ...]
    fault_free_iteration_time: float

    @classmethod
    def of(cls, engine) -> Before:
        return cls(engine.grid.membership.members, engine.fault_free_iteration_time())


def _net_changes(decision: Decision, members_before, members_after, worker_of) -> dict[str, tuple]:
    """Who left, failed and joined, by kind, as the members saw it: a leave or failure of a slot that
    was a member, a join of a slot that is one now, each slot once. A joiner that died while its
    join was pending is in the decision's changes twice (its join and its failure) but neither left
    nor joined (the coordinator's log says so)."""
    after = set(members_after)
    wanted = {LEAVE: set(members_before), FAILED: set(members_before), JOIN: after}
    workers: dict[str, tuple] = {}
    for kind in KINDS:
        slots = dict.fromkeys(c.slot for c in decision.changes if c.kind == kind and c.slot in wanted[kind])
        workers[kind] = tuple(worker_of(slot) for slot in slots)
    return workers


def membership_change(
    engine,
    decision: Decision,
    before: Before,
    switch_seconds: float,
    detected: float | None = None,
    rolled_back: bool = False,
) -> MembershipChange:
    """The change ``decision`` made, now that ``engine`` runs in the new epoch; logged once."""
    grid = engine.grid
    workers = _net_changes(decision, before.members, grid.membership.members, grid.worker_of)
    oldest = min((c.time for c in decision.changes), default=time.time())
    summary = engine.plan_summary(before.fault_free_iteration_time)
    now = time.time()
    change = MembershipChange(
        epoch=grid.membership.epoch,
        iteration=engine.global_steps,
        left=workers[LEAVE],
        failed=workers[FAILED],
        joined=workers[JOIN],
        detection_seconds=max(0.0, (detected or now - switch_seconds) - oldest),
        rebuild_seconds=switch_seconds,
        recovery_seconds=None if detected is None else now - oldest,
        rolled_back=rolled_back,
        plan=summary,
        time=now,
    )
    logger.info(describe(change))
    return change


def describe(change: MembershipChange) -> str:
    plan = change.plan
    line = (
        f"ReCycle epoch {change.epoch} from iteration {change.iteration}: left {list(change.left)} "
        f"failed {list(change.failed)} joined {list(change.joined)}; plan {plan.plan_id} predicts "
        f"{plan.predicted_iteration_time:.1f} ({plan.ratio_to_fault_free:.3f}x fault-free, "
        f"{plan.ratio_to_lower_bound:.3f}x lower bound), {plan.rerouted_microbatches} rerouted F; "
        f"detected/decided after {change.detection_seconds * 1e3:.0f} ms, switch {change.rebuild_seconds * 1e3:.0f} ms"
    )
    if change.recovery_seconds is not None:
        line += f", recovered {change.recovery_seconds * 1e3:.0f} ms after the failure"
    if change.rolled_back:
        line += ", in-flight iteration rolled back"
    return line
