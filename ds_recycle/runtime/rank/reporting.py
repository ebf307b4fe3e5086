"""One line and one :class:`~ds_recycle.runtime.shared.events.MembershipChange` per membership change,
and the record of the job that the status page shows.

The line follows DeepSpeed's log format and says, in one place: the epoch, who left, failed or
joined, the detection latency, the switch time, and the new plan against fault-free and its lower
bound. The engine hands the change to its monitors on the lowest live rank.

:func:`publish_status` writes the job's :class:`~ds_recycle.runtime.shared.status_schema.StatusReport`
(``status`` in the store): the plan the members run, with its Gantt chart, and the last
:data:`CHANGES_KEPT` changes. One member writes it: the lowest one that ran the change (a joiner
does not report its own join), at start, after every change and after every change of the cost
model. It reads the previous record first and carries its changes over, so the history survives
the death of whoever wrote it before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ds_recycle.log import logger
from ds_recycle.runtime.shared.events import MembershipChange
from ds_recycle.runtime.shared.job_store import JobStore
from ds_recycle.runtime.shared.records import FAILED, JOIN, LEAVE, MOVE, Decision
from ds_recycle.runtime.shared.status_schema import ChangeReport, GanttOp, PlanReport, StatusReport

KINDS = (LEAVE, FAILED, JOIN)
CHANGES_KEPT = 8
"""Changes the status record keeps (the newest)."""
GANTT_MAX_OPS = 2048
"""Ops of the plan the status record holds at most (about 50 KB); a larger plan's last workers are left out."""


@dataclass(frozen=True)
class Before:
    """What a change is measured against, taken before the new epoch is entered."""

    members: tuple[int, ...]
    fault_free_iteration_time: float

    @classmethod
    def of(cls, engine) -> Before:
        return cls(engine.grid.membership.members, engine.plans.fault_free_time())


def _net_changes(decision: Decision, members_before, members_after, worker_of) -> dict[str, tuple]:
    """Who left, failed and joined, by kind, as the members saw it: a leave or failure of a slot that
    was a member, a join of a slot that is one now, each slot once. A joiner that died while its
    join was pending is in the decision's changes twice (its join and its failure) but neither left
    nor joined (the coordinator's log says so)."""
    after = set(members_after)
    wanted = {LEAVE: set(members_before), FAILED: set(members_before), JOIN: after}
    workers: dict[str, tuple] = {}
    for kind in KINDS:
        kinds = (LEAVE, MOVE) if kind == LEAVE else (kind,)  # a mover leaves; its device joins as its target
        slots = dict.fromkeys(c.slot for c in decision.changes if c.kind in kinds and c.slot in wanted[kind])
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
        switch_seconds=switch_seconds,
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
        f"failed {list(change.failed)} joined {list(change.joined)}; plan {plan.plan_id}"
        f"{' (prefetched)' if plan.prefetched else ''} predicts "
        f"{plan.predicted_iteration_time:.1f} ({plan.ratio_to_fault_free:.3f}x fault-free, "
        f"{plan.ratio_to_lower_bound:.3f}x lower bound), {plan.rerouted_microbatches} rerouted F; "
        f"detected/decided after {change.detection_seconds * 1e3:.0f} ms, switch {change.switch_seconds * 1e3:.0f} ms"
    )
    if change.recovery_seconds is not None:
        line += f", recovered {change.recovery_seconds * 1e3:.0f} ms after the failure"
    if change.rolled_back:
        line += ", in-flight iteration rolled back"
    return line


def is_status_writer(engine, before_members: tuple[int, ...]) -> bool:
    """Whether this member writes the status record after a change from ``before_members``: the
    lowest member of the new epoch that was a member before (a joiner reports nothing)."""
    survivors = set(before_members) & set(engine.grid.membership.members)
    return bool(survivors) and engine.slot == min(survivors)


def publish_status(store: JobStore, engine, change: MembershipChange | None = None) -> StatusReport:
    """Write the job's status record for the plan ``engine`` runs now, with ``change`` appended to
    the changes of the record in the store."""
    previous = store.status_report()
    changes = () if previous is None else previous.changes
    if change is not None:
        changes = (*changes, change_report(change))
    report = status_report(engine, changes[-CHANGES_KEPT:])
    store.publish_status(report)
    return report


def change_report(change: MembershipChange) -> ChangeReport:
    return ChangeReport(
        epoch=change.epoch,
        iteration=change.iteration,
        left=tuple(change.left),
        failed=tuple(change.failed),
        joined=tuple(change.joined),
        detection_seconds=change.detection_seconds,
        switch_seconds=change.switch_seconds,
        recovery_seconds=change.recovery_seconds,
        rolled_back=change.rolled_back,
        time=change.time,
    )


def status_report(engine, changes: tuple[ChangeReport, ...]) -> StatusReport:
    grid, plan = engine.grid, engine.plan
    summary = engine.plan_summary()
    gantt: list[GanttOp] = []
    total = sum(len(ops) for ops in plan.workers.values())
    for (p, s), ops in sorted(plan.workers.items()):
        if len(gantt) + len(ops) > GANTT_MAX_OPS:
            break
        gantt += [GanttOp(p, s, op.kind, op.home, op.mb, round(op.start, 3), round(op.end, 3)) for op in ops]
    plan_report = PlanReport(
        plan_id=summary.plan_id,
        unit=engine.cost_unit,
        failed=tuple(summary.failed),
        slow=tuple(plan.costs.slow),
        predicted_iteration_time=summary.predicted_iteration_time,
        fault_free_iteration_time=summary.fault_free_iteration_time,
        lower_bound=summary.lower_bound,
        rerouted_microbatches=summary.rerouted_microbatches,
        gantt=tuple(gantt),
        gantt_omitted=total - len(gantt),
    )
    return StatusReport(
        epoch=grid.membership.epoch,
        iteration=engine.global_steps,
        pipelines=grid.data_parallel_size,
        stages=grid.pipe_parallel_size,
        microbatches=plan.microbatches,
        samples_per_iteration=engine.train_batch_size(),
        workers=tuple(grid.worker_of(slot) for slot in range(grid.topo.world_size())),
        plan=plan_report,
        changes=changes,
        writer=engine.slot,
        time=time.time(),
    )
