"""Real DeepSpeed engines in real processes on gloo, started by our launcher.

Each topology is launched once (module-scoped fixture); every rank runs several engines one
after the other from the same seed and data, and the tests compare what they wrote.
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_bitwise_equal, run_ranks

from ds_recycle.data import TokenWindowProvider, shipped_corpus_tokens
from ds_recycle.models import GPTReference, lm_loss
from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.list_scheduler import ScheduleOptions
from ds_recycle.planner.lowering import lower, stream_kinds
from ds_recycle.planner.plan import CostModel
from ds_recycle.testing.tiny import TINY_GPT, ds_config

pytestmark = pytest.mark.multiprocess

STEPS = 5
CLIP = 0.05
RECYCLE = {"enabled": True}
EVENT_KIND = {"ForwardPass": "F", "BackwardInput": "B", "BackwardWeight": "W", "StaggeredStep": "S"}


def parity_runs(m: int) -> list[dict]:
    return [
        {"name": f"{engine}-{opt}", "engine": engine, "optimizer": opt, "config": ds_config(m, 0.0, recycle)}
        for opt in ("sgd", "adam")
        for engine, recycle in (("stock", None), ("recycle", RECYCLE))
    ]


@pytest.fixture(scope="module")
def topology_2x2(tmp_path_factory):
    m = 4
    runs = parity_runs(m) + [
        {
            "name": "disabled-sgd",
            "engine": "recycle",
            "optimizer": "sgd",
            "config": ds_config(m, 0.0, {"enabled": False}),
        },
        {"name": "clip-staggered", "engine": "recycle", "optimizer": "sgd", "config": ds_config(m, CLIP, RECYCLE)},
        {"name": "clip-never-hit", "engine": "recycle", "optimizer": "adam", "config": ds_config(m, 1e6, RECYCLE)},
        {
            "name": "checkpointed",
            "engine": "recycle",
            "optimizer": "sgd",
            "config": ds_config(m, 0.0, RECYCLE),
            "checkpoint": 1,
        },
        {"name": "stock-data", "engine": "stock", "optimizer": "adam", "config": ds_config(m, 0.0), "data": "dataset"},
        {
            "name": "recycle-data",
            "engine": "recycle",
            "optimizer": "adam",
            "config": ds_config(m, 0.0, RECYCLE),
            "data": "dataset",
        },
        {
            "name": "clip-synchronous",
            "engine": "recycle",
            "optimizer": "sgd",
            "config": ds_config(m, CLIP, {"enabled": True, "staggered_optimizer": False}),
        },
    ]
    return 2, 2, m, run_ranks(tmp_path_factory.mktemp("pp2dp2"), pp=2, dp=2, runs=runs, steps=STEPS)


@pytest.fixture(scope="module")
def topology_4x1(tmp_path_factory):
    m = 8
    timing = {"F": 15, "B": 15, "W": 15}
    staggered = {"decoupled_backprop": False, "emulate_timing": timing}
    synchronous = {"decoupled_backprop": False, "staggered_optimizer": False, "emulate_timing": timing}
    runs = parity_runs(m) + [
        {
            "name": "emulated-staggered",
            "engine": "recycle",
            "optimizer": "sgd",
            "config": ds_config(m, 0.0, staggered),
        },
        {"name": "emulated-sync", "engine": "recycle", "optimizer": "sgd", "config": ds_config(m, 0.0, synchronous)},
        {"name": "clip-staggered", "engine": "recycle", "optimizer": "sgd", "config": ds_config(m, CLIP, RECYCLE)},
        {
            "name": "undecoupled-synchronous",
            "engine": "recycle",
            "optimizer": "sgd",
            "config": ds_config(m, 0.0, {"decoupled_backprop": False, "staggered_optimizer": False}),
        },
    ]
    return 4, 1, m, run_ranks(tmp_path_factory.mktemp("pp4dp1"), pp=4, dp=1, runs=runs, steps=STEPS)


@pytest.fixture(scope="module")
def topology_2x3(tmp_path_factory):
    m = 4
    return 2, 3, m, run_ranks(tmp_path_factory.mktemp("pp2dp3"), pp=2, dp=3, runs=parity_runs(m), steps=STEPS)


@pytest.mark.parametrize("topology", ["topology_2x2", "topology_4x1", "topology_2x3"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_parity_with_stock_deepspeed(request, topology, optimizer):
    _pp, _dp, _m, dumps = request.getfixturevalue(topology)
    stock, ours = dumps[f"stock-{optimizer}"], dumps[f"recycle-{optimizer}"]
    assert all(d["engine"] == "RecyclePipelineEngine" for d in ours)
    assert all(d["engine"] == "PipelineEngine" for d in stock)
    assert len(stock[0]["losses"]) == STEPS
    assert stock[0]["losses"][0] != stock[0]["losses"][-1], "training did not move the parameters"
    assert_bitwise_equal(stock, ours)


def test_every_option_combination_keeps_stock_numerics(topology_4x1):
    _pp, _dp, _m, dumps = topology_4x1
    assert_bitwise_equal(dumps["stock-sgd"], dumps["undecoupled-synchronous"])
    assert_bitwise_equal(dumps["stock-sgd"], dumps["emulated-staggered"])
    assert_bitwise_equal(dumps["stock-sgd"], dumps["emulated-sync"])


def test_clipping_that_never_triggers_changes_nothing(topology_2x2):
    """The optimistic step with its snapshot is exact when the global norm stays under the limit."""
    _pp, _dp, _m, dumps = topology_2x2
    assert all(n < 1e6 for d in dumps["clip-never-hit"] for n in d["grad_norms"])
    assert_bitwise_equal(dumps["stock-adam"], dumps["clip-never-hit"])


def test_activation_checkpointing_keeps_stock_numerics(topology_2x2):
    """DeepSpeed's checkpoint functions refuse autograd.grad; the engine swaps in torch's
    non-reentrant checkpoint, which recomputes the same values."""
    _pp, _dp, _m, dumps = topology_2x2
    assert_bitwise_equal(dumps["stock-sgd"], dumps["checkpointed"])


def test_training_data_is_stock_deepspeeds_data_loader(topology_2x2):
    """training_data=dataset: ReCycle loads micro-batch (h, k) of iteration i itself, for any
    pipeline; fault-free, that is exactly what stock DeepSpeed's own loader gives pipeline h."""
    _, _, _, runs = topology_2x2
    assert_bitwise_equal(runs["stock-data"], runs["recycle-data"])
    assert runs["recycle-data"][0]["losses"] != runs["recycle-adam"][0]["losses"], "the dataset was not used"


def test_disabled_recycle_is_stock_deepspeed(topology_2x2):
    _pp, _dp, _m, dumps = topology_2x2
    assert all(d["engine"] == "RecyclePipelineEngine" for d in dumps["disabled-sgd"])
    assert_bitwise_equal(dumps["stock-sgd"], dumps["disabled-sgd"])


def torch_reference(dumps: list[dict], dp: int, m: int, optimizer: str, clip: float, steps: int):
    """The same model, global batch and optimizer in one process, clipped by the true global norm.

    The tests use SGD: Adam divides by the root of the second moment, so a gradient that is zero up
    to rounding (the attention key bias) becomes a full-size step whose sign is the rounding noise's,
    and no tolerance separates that from a real error."""
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = GPTReference(cfg)
    initial = {}
    for dump in sorted(dumps, key=lambda d: -d["stage"]):  # the first stage's copy of the tied weight wins
        initial.update(dump["initial"])
    model.load_state_dict(initial, strict=True)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    provider = TokenWindowProvider(tokens, cfg.seq_len, 2, seed=0)
    losses, norms = [], []
    for iteration in range(steps):
        opt.zero_grad()
        total = 0.0
        for home in range(dp):
            for mb in range(m):
                x, y = provider.get(iteration, home, mb)
                loss = lm_loss(model(x), y) / (dp * m)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(total)
    return model.state_dict(), losses, norms


def assert_matches_reference(dumps, reference_params, rtol, atol):
    for dump in dumps:
        for name, value in dump["params"].items():
            torch.testing.assert_close(
                value, reference_params[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.parametrize("run", ["clip-staggered", "clip-synchronous"])
def test_clipping_uses_true_global_norm_2x2(topology_2x2, run):
    _pp, dp, m, dumps = topology_2x2
    params, losses, norms = torch_reference(dumps[run], dp, m, "sgd", CLIP, STEPS)
    ours = dumps[run]
    assert all(n > CLIP for n in norms), "the reference must clip on every step for this test to bite"
    for dump in ours:
        torch.testing.assert_close(dump["grad_norms"], norms, rtol=1e-5, atol=0)
        torch.testing.assert_close(dump["losses"], losses, rtol=1e-5, atol=0)
    assert_matches_reference(ours, params, rtol=1e-5, atol=1e-6)


def test_clipping_uses_true_global_norm_4x1(topology_4x1):
    _pp, dp, m, dumps = topology_4x1
    params, _losses, norms = torch_reference(dumps["clip-staggered"], dp, m, "sgd", CLIP, STEPS)
    assert all(n > CLIP for n in norms)
    assert_matches_reference(dumps["clip-staggered"], params, rtol=1e-5, atol=1e-6)


def _step_end_and_stage0_backward_end(dumps, stage, iteration):
    by_stage = {d["stage"]: d for d in dumps}
    backward = ("BackwardInput", "BackwardWeight")
    stage0_end = max(end for name, *_r, end in by_stage[0]["events"][iteration] if name in backward)
    step_end = next(end for name, *_r, end in by_stage[stage]["events"][iteration] if name == "StaggeredStep")
    return step_end, stage0_end


def test_later_stages_step_before_stage0_finishes_its_backward(topology_4x1):
    """Staggering is real: with each op padded to 15 ms and W right after B (1F1B order, so the
    last stage is done three backward steps before stage 0), the last stage's optimizer step has
    ended before stage 0's last backward. The synchronous control run waits for stage 0."""
    pp, _dp, _m, dumps = topology_4x1
    for iteration in range(1, STEPS):
        step_end, stage0_end = _step_end_and_stage0_backward_end(dumps["emulated-staggered"], pp - 1, iteration)
        assert step_end < stage0_end, f"iteration {iteration}: the last stage stepped after stage 0's last backward"
        step_end, stage0_end = _step_end_and_stage0_backward_end(dumps["emulated-sync"], pp - 1, iteration)
        assert step_end >= stage0_end, f"iteration {iteration}: the synchronous step did not wait for stage 0"


@pytest.mark.parametrize("topology", ["topology_2x2", "topology_4x1"])
def test_engine_runs_the_planners_fault_free_schedule(request, topology):
    pp, dp, m, dumps = request.getfixturevalue(topology)
    # the plan of the costs the replicas agreed on (recycle.profile: measured after the warm-up)
    costs = CostModel.from_dict(dumps["recycle-sgd"][0]["costs"][-1])
    streams = lower(fault_free_plan(dp, pp, m, costs=costs, options=ScheduleOptions()))
    for dump in dumps["recycle-sgd"]:
        assert dump["costs"] == dumps["recycle-sgd"][0]["costs"]
        ran = [(EVENT_KIND[name], home, mb) for name, home, mb, *_t in dump["events"][-1] if name in EVENT_KIND]
        assert ran == stream_kinds(streams[(dump["pipeline"], dump["stage"])])
