"""Lowering: streams as pure data, the way DeepSpeed's own schedule tests check them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import survivable_failures

from ds_recycle.instructions import RecvActivation, RecvGrad, SendActivation
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.lowering import StreamError, check_streams, lower, stream_kinds
from ds_recycle.planner.plan import CostModel
from ds_recycle.planner.validator import validate


@pytest.mark.parametrize("D,P,m", [(1, 1, 1), (1, 2, 3), (1, 4, 8), (2, 4, 4), (2, 3, 7), (3, 8, 16)])
def test_fault_free_streams_follow_the_plan(D, P, m):
    """The engine runs fault_free_plan(D, P, m) through lower(): its compute ops are the plan's."""
    plan = fault_free_plan(D, P, m)
    validate(plan)
    streams = lower(plan)
    check_streams(streams)
    for worker, ops in plan.workers.items():
        assert stream_kinds(streams[worker]) == [(op.kind, op.home, op.mb) for op in ops]
        assert streams[worker].num_buffers <= plan.memory_cap


@st.composite
def failure_cases(draw):
    D = draw(st.integers(2, 4))
    P = draw(st.integers(1, 5))
    m = draw(st.integers(1, 6))
    return D, P, m, draw(survivable_failures(D, P, max_size=D))


@settings(max_examples=25, deadline=None)
@given(failure_cases())
def test_every_plan_lowers_without_deadlock(case):
    D, P, m, failed = case
    plan = plan_heuristic(D, P, m, failed, costs=CostModel.uniform(P, comm=0.25))
    streams = lower(plan)
    check_streams(streams)
    for worker, ops in plan.workers.items():
        assert stream_kinds(streams[worker]) == [(op.kind, op.home, op.mb) for op in ops]
        assert streams[worker].num_buffers <= plan.memory_cap
    # re-routed work is received from the worker that really produced it
    runners = plan.runners()
    for worker, stream in streams.items():
        for ins in stream.instructions:
            if isinstance(ins, RecvActivation):
                assert runners[("F", ins.home, ins.mb, worker[1] - 1)] == ins.peer


def test_missing_receive_is_caught():
    streams = lower(fault_free_plan(1, 2, 2))
    stream = streams[(0, 1)]
    index = next(i for i, ins in enumerate(stream.instructions) if isinstance(ins, RecvActivation))
    del stream.instructions[index]
    with pytest.raises(StreamError, match=r"SendActivation of micro-batch \(0,0\).*1 send\(s\) and 0 receive\(s\)"):
        check_streams(streams)


def test_receive_from_wrong_peer_is_caught():
    streams = lower(plan_heuristic(2, 2, 2, [(0, 1)]))
    for _worker, stream in streams.items():
        for i, ins in enumerate(stream.instructions):
            if isinstance(ins, RecvGrad):
                stream.instructions[i] = RecvGrad(ins.buffer_id, ins.home, ins.mb, (1 - ins.peer[0], ins.peer[1]))
                with pytest.raises(StreamError, match="exactly one of each"):
                    check_streams(streams)
                return
    pytest.fail("no RecvGrad in the streams")


def test_swapped_order_deadlocks():
    streams = lower(fault_free_plan(1, 2, 1))
    first = streams[(0, 0)].instructions
    send = next(i for i, ins in enumerate(first) if isinstance(ins, SendActivation))
    recv = next(i for i, ins in enumerate(first) if isinstance(ins, RecvGrad))
    # stage 0 now waits for the gradient before it sends the activation the gradient needs
    first[send], first[recv] = first[recv], first[send]
    with pytest.raises(StreamError, match="deadlock"):
        check_streams(streams)
