"""Forward-only plans (evaluation): every micro-batch forwarded once per stage, on live workers only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import survivable_failures

from ds_recycle.planner.actions import ForwardPass, LoadMicroBatch, MicroBatchAction, RecvActivation, SendActivation
from ds_recycle.planner.evaluation import forwards, lower_forward_only
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.lowering import check_pair_order
from ds_recycle.planner.plan import CostModel


def check_evaluation(streams, D: int, P: int, m: int, failed) -> None:
    assert set(streams) == {(p, s) for p in range(D) for s in range(P)} - set(failed)
    ran = forwards(streams)
    assert set(ran) == {(h, k, s) for h in range(D) for k in range(m) for s in range(P)}
    assert all(len(workers) == 1 for workers in ran.values()), "a micro-batch ran twice at a stage"
    check_pair_order(streams)
    for worker, stream in streams.items():
        kinds = {type(a) for a in stream.actions}
        assert kinds <= {LoadMicroBatch, RecvActivation, ForwardPass, SendActivation}
        if worker[1] not in (0, P - 1):
            assert LoadMicroBatch not in kinds
        holder: dict[int, tuple[int, int]] = {}
        done: set[tuple[int, int]] = set()
        for action in stream.actions:
            assert isinstance(action, MicroBatchAction)
            key = (action.home, action.mb)
            assert key not in done
            assert holder.setdefault(action.buffer_id, key) == key, f"{worker}: {action} shares a live slot"
            last = isinstance(action, SendActivation) or (worker[1] == P - 1 and isinstance(action, ForwardPass))
            if last:
                del holder[action.buffer_id]
                done.add(key)
        assert not holder, f"{worker}: micro-batches {list(holder.values())} never finished"


def test_fault_free_evaluation_is_stocks_order():
    """Fault-free, each stage forwards its own pipeline's micro-batches in order 0..m-1, as
    DeepSpeed's InferenceSchedule does (so the loss sums in the same order), in two buffers."""
    D, P, m = 2, 4, 8
    streams = lower_forward_only(fault_free_plan(D, P, m))
    check_evaluation(streams, D, P, m, ())
    for (pipeline, _stage), stream in streams.items():
        ran = [(a.home, a.mb) for a in stream.actions if isinstance(a, ForwardPass)]
        assert ran == [(pipeline, k) for k in range(m)]
        assert stream.num_buffers <= 2


@st.composite
def failure_cases(draw):
    D = draw(st.integers(2, 4))
    P = draw(st.integers(1, 5))
    m = draw(st.integers(1, 6))
    return D, P, m, draw(survivable_failures(D, P, max_size=D))


@settings(max_examples=30, deadline=None)
@given(failure_cases())
def test_every_failure_set_evaluates_each_micro_batch_once(case):
    D, P, m, failed = case
    plan = plan_heuristic(D, P, m, failed, costs=CostModel.uniform(P, comm=0.25))
    check_evaluation(lower_forward_only(plan), D, P, m, failed)
