"""The memory cap's arithmetic, its agreement table, the peaks it is checked against, the meter
that measures a micro-batch on the engine's buffers, and the config key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine.backward_split import backward_input, backward_weight
from ds_recycle.engine.held_memory import measure_held_bytes
from ds_recycle.engine.memory_cap import (
    GIB,
    UNBOUNDED,
    BudgetRow,
    HeldMeter,
    MemoryBudget,
    StageMemory,
    agree_budget,
    executed_peak,
    limit_bytes,
    peak_in_flight,
    static_bytes,
)
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.engine.weight_grad import install_weight_grad_path
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.heuristic import plan_heuristic
from ds_recycle.planner.validator import PlanError, validate


def test_a_stage_cap_is_the_micro_batches_that_fit_beside_the_static_bytes():
    assert StageMemory(per_microbatch=100, static=1000, limit=1299).cap == 2
    assert StageMemory(per_microbatch=100, static=1000, limit=1300).cap == 3
    assert StageMemory(per_microbatch=100, static=1000, limit=1099).cap == 0
    assert StageMemory(per_microbatch=100, static=1000, limit=900).cap < 0
    assert StageMemory(per_microbatch=0, static=1000, limit=1000).cap == UNBOUNDED
    assert StageMemory(per_microbatch=0, static=1001, limit=1000).cap == 0
    assert StageMemory(per_microbatch=100, static=1000, limit=1299).bytes_with(3) == 1300


def test_the_planner_gets_the_least_stage_cap_only_below_the_stage_count():
    roomy = MemoryBudget((StageMemory(10, 0, 100), StageMemory(10, 0, 1000)))
    assert roomy.caps == (10, 100) and roomy.planner_cap() is None
    tight = MemoryBudget((StageMemory(10, 0, 100), StageMemory(60, 50, 200), StageMemory(1, 0, 10**6)))
    assert tight.caps == (10, 2, 10**6) and tight.least == 2 and tight.planner_cap() == 2
    none_fits = MemoryBudget((StageMemory(10, 95, 100), StageMemory(1, 0, 100)))
    assert none_fits.planner_cap() == 0
    assert "stage 1: 50 static + 60 per micro-batch of 200 -> cap 2" in tight.describe()
    assert tight.shortfall(1, 3) == "stage 1 needs 50 static + 3 x 60 bytes = 230 bytes of its 200"


def test_a_plan_is_over_the_budget_where_a_worker_holds_more_than_its_stage_cap():
    budget = MemoryBudget((StageMemory(10, 0, 30), StageMemory(10, 0, 20), StageMemory(10, 0, 30)))
    plan = fault_free_plan(2, 3, 4)
    peaks = peak_in_flight(plan)
    assert max(peaks.values()) == 3
    over = budget.over(peaks)
    assert over and all(worker[1] == 1 and held > 2 and cap == 2 for worker, held, cap in over)
    capped = plan_heuristic(2, 3, 4, [(1, 1)], memory_cap=budget.planner_cap())
    validate(capped)
    assert budget.over(peak_in_flight(capped)) == []


def test_peak_in_flight_agrees_with_the_validator():
    plan = plan_heuristic(2, 3, 6, [(0, 1)])
    peaks = peak_in_flight(plan)
    assert max(peaks.values()) <= plan.memory_cap
    plan.memory_cap = max(peaks.values()) - 1
    with pytest.raises(PlanError, match="memory cap"):
        validate(plan, streams=False)


def test_the_executed_peak_counts_from_the_start_of_f_to_the_end_of_w():
    events = [
        InstructionEvent("ForwardPass", 0, 0, 0.0, 1.0),
        InstructionEvent("ForwardPass", 0, 1, 1.0, 2.0),
        InstructionEvent("BackwardInput", 0, 0, 2.0, 3.0),
        InstructionEvent("BackwardWeight", 0, 0, 3.0, 4.0),
        InstructionEvent("ForwardPass", 0, 2, 4.0, 5.0),  # starts as the W of mb 0 ends: 2 held, not 3
        InstructionEvent("BackwardWeight", 0, 1, 5.0, 6.0),
        InstructionEvent("BackwardWeight", 0, 2, 6.0, 7.0),
    ]
    assert executed_peak(events) == 2
    assert executed_peak(events[:2]) == 2
    assert executed_peak([]) == 0


def _all_reduce_with(others: list[torch.Tensor]):
    def all_reduce(table: torch.Tensor) -> None:
        for other in others:
            table += other

    return all_reduce


def _row_table(row: BudgetRow, worker: tuple[int, int], pipelines: int, stages: int) -> torch.Tensor:
    table = torch.zeros(pipelines * stages, len(row.values()), dtype=torch.float64)
    table[worker[0] * stages + worker[1]] = torch.tensor(row.values(), dtype=torch.float64)
    return table


def test_the_agreed_table_takes_each_stages_largest_bytes_and_least_limit():
    """D = 2, P = 2. Worker (1, 0) is dead (no row); (1, 1) joined and measured nothing yet."""
    rows = {
        (0, 0): BudgetRow(1, 1, 100, 1000, 5000),
        (0, 1): BudgetRow(1, 1, 300, 2000, 6000),
        (1, 1): BudgetRow(1, 0, 0, 2100, 5500),
    }
    others = [_row_table(row, w, 2, 2) for w, row in rows.items() if w != (0, 0)]
    budget = agree_budget(rows[(0, 0)], (0, 0), 2, 2, _all_reduce_with(others))
    assert budget == MemoryBudget((StageMemory(100, 1000, 5000), StageMemory(300, 2100, 5500)))
    assert budget.caps == (40, 11)


def test_no_agreement_while_a_stage_has_no_measured_replica():
    rows = {(0, 0): BudgetRow(1, 1, 100, 1000, 5000), (0, 1): BudgetRow(1, 0, 0, 2000, 5000)}
    others = [_row_table(rows[(0, 1)], (0, 1), 1, 2)]
    assert agree_budget(rows[(0, 0)], (0, 0), 1, 2, _all_reduce_with(others)) is None


def test_static_bytes_count_parameters_gradients_and_optimizer_state():
    layer = nn.Linear(4, 3)  # 15 fp32 parameters: 60 bytes
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    cpu = torch.device("cpu")
    assert static_bytes(layer, optimizer, cpu) == 60 + 60  # a gradient not allocated yet still counts
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # momentum buffers: 60 more
    assert static_bytes(layer, optimizer, cpu) == 60 + 60 + 60
    adam = torch.optim.Adam(layer.parameters())
    adam.step()  # exp_avg, exp_avg_sq (60 each) and two scalar step tensors (4 each)
    assert static_bytes(layer, adam, cpu) == 60 + 60 + 120 + 8


def test_the_meter_counts_what_held_memory_counts_on_the_engines_buffers():
    """The meter follows one micro-batch through F, B and W as the engine runs them (buffers that
    hold its input and output, the W path's probe) and finds the bytes measure_held_bytes finds."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    path = install_weight_grad_path(stage)
    x = torch.randn(4, 16)
    expected = measure_held_bytes(stage, x, path)
    for p in stage.parameters():
        p.grad = None
    meter = HeldMeter(list(stage.parameters()), audit=True)
    assert meter.wants()
    buffers = {"inputs": x.clone().requires_grad_(True)}
    probe: list[torch.Tensor] = []
    path.probe = probe
    buffers["outputs"] = stage(buffers["inputs"])
    path.probe = None
    meter.after_forward(0, [buffers["outputs"].grad_fn], probe, lambda: list(buffers.values()))
    grad = torch.randn(buffers["outputs"].shape, generator=torch.Generator().manual_seed(0))
    params = [p for p in stage.parameters() if p.requires_grad]
    _, work = backward_input([buffers["outputs"]], [grad], [buffers["inputs"]], params, path=path)
    buffers["outputs"] = None
    meter.after_backward_input(0, work)
    backward_weight(work)
    meter.after_backward_weight(0)
    assert meter.first == (expected.after_forward, expected.between_b_and_w)
    assert meter.per_microbatch == max(expected.after_forward, expected.between_b_and_w)
    assert meter.take_peak() == meter.per_microbatch and meter.take_peak() == 0
    assert not HeldMeter(params).wants() or HeldMeter(params).first is None


def test_limit_bytes_is_gibibytes():
    assert limit_bytes(None) is None
    assert limit_bytes(1) == GIB
    assert limit_bytes(0.5) == GIB // 2


@pytest.mark.parametrize("value", [0, -1, "16", True, {}, float("nan"), float("inf"), 2e6, [1]])
def test_a_bad_memory_limit_names_the_key_and_the_allowed_values(value):
    with pytest.raises(RecycleConfigError) as error:
        RecycleConfig.from_ds_config({"recycle": {"memory_limit_gb": value}})
    message = str(error.value)
    assert message.startswith("recycle.memory_limit_gb must be a number of GiB in (0, 1048576]"), message
    assert "or absent (on a GPU: the device's memory)" in message and repr(value) in message


def test_a_memory_limit_is_read_as_a_number_of_gib():
    assert RecycleConfig.from_ds_config({"recycle": {"memory_limit_gb": 16}}).memory_limit_gb == 16.0
    assert RecycleConfig.from_ds_config({"recycle": {"memory_limit_gb": 0.25}}).memory_limit_gb == 0.25
    assert RecycleConfig.from_ds_config({"recycle": {"memory_limit_gb": None}}).memory_limit_gb is None
    assert RecycleConfig.from_ds_config({"recycle": {}}).memory_limit_gb is None
