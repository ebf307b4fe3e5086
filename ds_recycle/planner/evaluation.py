"""Forward-only plans: evaluation over the live workers.

An evaluation batch runs every micro-batch ``(home, mb)`` forward through every stage once, with
no backward and no step. :func:`forward_only` keeps the F ops of a training plan, on the workers
and in the order the plan gives them, so a home pipeline's micro-batches are routed through the
live workers exactly as the training plan routes their F: whatever the failure set, each
micro-batch is forwarded once per stage. :func:`lower_forward_only` lowers it with the training
lowering (the same transfers, in an order both sides of every pair agree on), checks the streams
(:func:`~ds_recycle.planner.lowering.check_streams`), and lets a micro-batch's buffer slot go
after its last action: without a backward, nothing of it is needed after its activation was sent.
"""

from __future__ import annotations

import dataclasses

from ds_recycle.planner.actions import ForwardPass, MicroBatchAction
from ds_recycle.planner.lowering import WorkerStream, check_streams, lower
from ds_recycle.planner.plan import FORWARD, Plan, Worker


def forward_only(plan: Plan) -> Plan:
    """``plan`` with only its F ops (their workers and order unchanged)."""
    workers = {worker: [op for op in ops if op.kind == FORWARD] for worker, ops in plan.workers.items()}
    ends = [op.end for ops in workers.values() for op in ops]
    return dataclasses.replace(
        plan, workers=workers, iteration_time=max(ends, default=0.0), extra={**plan.extra, "forward_only": True}
    )


def lower_forward_only(plan: Plan) -> dict[Worker, WorkerStream]:
    """One forward-only stream per live worker of ``plan`` (a training plan or its forward-only part)."""
    streams = lower(forward_only(plan))
    check_streams(streams)
    return {worker: _reuse_buffers(stream) for worker, stream in streams.items()}


def _reuse_buffers(stream: WorkerStream) -> WorkerStream:
    """Give each micro-batch a slot from its first action to its last one, then free it."""
    last: dict[tuple[int, int], int] = {}
    for i, action in enumerate(stream.actions):
        if isinstance(action, MicroBatchAction):
            last[(action.home, action.mb)] = i
    slot_of: dict[tuple[int, int], int] = {}
    free: list[int] = []
    slots = 0
    actions = []
    for i, action in enumerate(stream.actions):
        if not isinstance(action, MicroBatchAction):
            actions.append(action)
            continue
        key = (action.home, action.mb)
        if key not in slot_of:
            if free:
                slot_of[key] = free.pop()
            else:
                slot_of[key] = slots
                slots += 1
        actions.append(dataclasses.replace(action, buffer_id=slot_of[key]))
        if last[key] == i:
            free.append(slot_of.pop(key))
    return WorkerStream(stream.worker, actions, max(slots, 1))


def forwards(streams: dict[Worker, WorkerStream]) -> dict[tuple[int, int, int], list[Worker]]:
    """``(home, mb, stage) -> [workers that run its F]``: exactly one each in a valid evaluation."""
    ran: dict[tuple[int, int, int], list[Worker]] = {}
    for worker, stream in streams.items():
        for action in stream.actions:
            if isinstance(action, ForwardPass):
                ran.setdefault((action.home, action.mb, worker[1]), []).append(worker)
    return ran
