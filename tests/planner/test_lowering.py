"""Lowering: streams as pure data, the way DeepSpeed's own schedule tests check them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import survivable_failures
from streams import check_lowering

from ds_recycle.planner.actions import RecvActivation, RecvGrad, SendActivation, SendGrad
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.lowering import StreamError, check_pair_order, check_streams, lower, stream_kinds, transfers
from ds_recycle.planner.plan import CostModel, Plan
from ds_recycle.planner.simulate import retime
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
        for ins in stream.actions:
            if isinstance(ins, RecvActivation):
                assert runners[("F", ins.home, ins.mb, worker[1] - 1)] == ins.peer


def test_missing_receive_is_caught():
    streams = lower(fault_free_plan(1, 2, 2))
    stream = streams[(0, 1)]
    index = next(i for i, ins in enumerate(stream.actions) if isinstance(ins, RecvActivation))
    del stream.actions[index]
    with pytest.raises(StreamError, match=r"SendActivation of micro-batch \(0,0\).*1 send\(s\) and 0 receive\(s\)"):
        check_streams(streams)


def test_receive_from_wrong_peer_is_caught():
    streams = lower(plan_heuristic(2, 2, 2, [(0, 1)]))
    for _worker, stream in streams.items():
        for i, ins in enumerate(stream.actions):
            if isinstance(ins, RecvGrad):
                stream.actions[i] = RecvGrad(ins.buffer_id, ins.home, ins.mb, (1 - ins.peer[0], ins.peer[1]))
                with pytest.raises(StreamError, match="exactly one of each"):
                    check_streams(streams)
                return
    pytest.fail("no RecvGrad in the streams")


def test_swapped_order_deadlocks():
    streams = lower(fault_free_plan(1, 2, 1))
    first = streams[(0, 0)].actions
    send = next(i for i, ins in enumerate(first) if isinstance(ins, SendActivation))
    recv = next(i for i, ins in enumerate(first) if isinstance(ins, RecvGrad))
    # stage 0 now waits for the gradient before it sends the activation the gradient needs
    first[send], first[recv] = first[recv], first[send]
    with pytest.raises(StreamError, match="deadlock"):
        check_streams(streams)


def reversed_last_stage() -> Plan:
    """D=1, P=2, m=2 with stage 1 running micro-batch 1 before 0: stage 0 sends its activations in
    the order 0, 1 and stage 1 wants 1, 0; the gradients come back 1, 0 and stage 0 wants 0, 1."""
    plan = fault_free_plan(1, 2, 2)
    first = {("F", 0, 1): 0, ("B", 0, 1): 1, ("W", 0, 1): 2, ("F", 0, 0): 3, ("B", 0, 0): 4, ("W", 0, 0): 5}
    plan.workers[(0, 1)].sort(key=lambda op: first.get((op.kind, op.home, op.mb), len(first)))
    plan = retime(plan)
    validate(plan)
    return plan


def test_each_pair_posts_its_transfers_in_one_order():
    """Stage 0 holds its activation 0 back until activation 1 is sent, and receives gradient 1
    before gradient 0; the compute keeps the plan's order and no buffer is added."""
    streams = check_lowering(reversed_last_stage())
    assert [(type(ins).__name__, getattr(ins, "mb", None)) for ins in streams[(0, 0)].actions] == [
        ("LoadMicroBatch", 0),
        ("ForwardPass", 0),
        ("LoadMicroBatch", 1),
        ("ForwardPass", 1),
        ("SendActivation", 1),
        ("SendActivation", 0),
        ("RecvGrad", 1),
        ("RecvGrad", 0),
        ("BackwardInput", 0),
        ("BackwardWeight", 0),
        ("BackwardInput", 1),
        ("BackwardWeight", 1),
        ("StaggeredStep", None),
    ]
    assert transfers(streams)[((0, 0), (0, 1))] == ([("activation", 0, 1), ("activation", 0, 0)],) * 2
    assert transfers(streams)[((0, 1), (0, 0))] == ([("gradient", 0, 1), ("gradient", 0, 0)],) * 2


def test_receives_out_of_the_senders_order_are_caught():
    streams = lower(fault_free_plan(1, 2, 2))
    instructions = streams[(0, 1)].actions
    first, second = (i for i, ins in enumerate(instructions) if isinstance(ins, RecvActivation))
    instructions[first], instructions[second] = instructions[second], instructions[first]
    with pytest.raises(
        StreamError,
        match=r"from \(0, 0\) to \(0, 1\) are posted in different orders: transfer 0 of the pair is the "
        r"activation of micro-batch \(0,0\) on \(0, 0\) but the activation of micro-batch \(0,1\) on \(0, 1\)",
    ):
        check_pair_order(streams)


def test_step_must_end_the_stream():
    streams = lower(fault_free_plan(1, 2, 2))
    stream = streams[(0, 0)]
    step = stream.actions.pop()
    stream.actions.insert(len(stream.actions) - 1, step)
    with pytest.raises(StreamError, match=r"worker \(0, 0\): StaggeredStep must be the stream's one last"):
        check_streams(streams)


def test_a_buffer_used_after_its_backward_weight_is_caught():
    streams = lower(fault_free_plan(1, 2, 2))
    stream = streams[(0, 1)]
    last_send = max(i for i, ins in enumerate(stream.actions) if isinstance(ins, SendGrad))
    send = stream.actions.pop(last_send)
    stream.actions.insert(len(stream.actions) - 1, send)
    with pytest.raises(StreamError, match=r"SendGrad\(buffer_id=1, home=0, mb=1.*after the BackwardWeight"):
        check_streams(streams)
