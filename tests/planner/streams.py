"""The lowering check shared by the planner tests: every plan a test makes is also lowered."""

from __future__ import annotations

from ds_recycle.planner.lowering import WorkerStream, check_streams, lower, stream_kinds
from ds_recycle.planner.plan import Plan, Worker


def check_lowering(plan: Plan) -> dict[Worker, WorkerStream]:
    """Lower ``plan`` and check its streams: matched transfers in one order per directed pair of
    workers (p2p without tags), no deadlock, buffers within the memory cap, the plan's compute."""
    streams = lower(plan)
    check_streams(streams)
    for worker, ops in plan.workers.items():
        assert stream_kinds(streams[worker]) == [(op.kind, op.home, op.mb) for op in ops]
        assert streams[worker].num_buffers <= plan.memory_cap
    return streams
