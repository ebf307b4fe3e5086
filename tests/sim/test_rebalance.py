"""ReCycle's rebalancing (sim/rebalance.py, sim/repair.py): moves, their cost, when they pay, the CLI option."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from helpers import small_job

from ds_recycle.cli import main
from ds_recycle.cli.simulate import DEFAULT_REBALANCE, REBALANCE_NAMES
from ds_recycle.planner.cache import PlanCache
from ds_recycle.sim.job import Job
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.rebalance import MODES, Move, RebalanceParams, Rebalancer, pays
from ds_recycle.sim.recycle import Recycle, RecycleParams
from ds_recycle.sim.repair import RepairEstimate
from ds_recycle.sim.timeline import replay
from ds_recycle.sim.traces import read_trace, shipped_traces

NODES16 = [f"n{i}" for i in range(16)]


def _recycle(mode: str, job: Job | None = None, **kw) -> Recycle:
    return Recycle(job or small_job(4, 4, 8), RecycleParams(rebalance=RebalanceParams(mode), **kw))


def _live(recycle: Recycle) -> int:
    return sum(1 for node in recycle.slots if node is not None)


def test_a_migration_keeps_the_live_workers_and_charges_its_copy() -> None:
    """Two failures on the last stage (4 x 4 grid): survivors of other stages move into its dead
    slots; the nodes are the same ones, the pause is the copy of the last stage's state from its
    two live replicas, a group rebuild and a plan lookup, and the rate rises."""
    job = small_job(4, 4, 8)
    fixed, moving = _recycle("off", job), _recycle("migrate", job)
    for system in (fixed, moving):
        system.start(NODES16)
    fixed.change(0.0, ["n3", "n7"], [])
    phases = moving.change(0.0, ["n3", "n7"], [])
    assert [p.what for p in phases[:-1]] == ["lost work", "recover", "rebalance"]
    assert _live(moving) == _live(fixed) == 14
    assert sorted(n for n in moving.slots if n) == sorted(n for n in fixed.slots if n)
    (_when, reshape, pause) = moving.reshapes[-1]
    assert reshape.kind == "migrate" and len(reshape.moves) == 2
    assert all(move.target[1] == 3 and move.source[1] != 3 for move in reshape.moves)
    copy = job.layout.stage_state_bytes[3] / job.hw.network_bandwidth  # 2 movers, 2 sources: one round
    assert reshape.copy_s == pytest.approx(copy)
    assert pause == pytest.approx(copy + moving.params.rebuild_s + moving.params.lookup_s)
    assert phases[2].duration == pytest.approx(pause)
    assert moving.rebalancer.live(moving.failed()) == [3, 3, 4, 4]
    assert moving.rate() > fixed.rate() * 1.05
    assert moving.layers == job.layout.layers and "migrate" in moving.notes


def test_a_source_serving_several_movers_copies_in_rounds() -> None:
    job = small_job(4, 4, 8)
    rebalancer = Rebalancer(job, RebalanceParams("migrate"), lambda failed, layers: 1.0)
    failed = ((0, 3), (1, 3), (2, 3))
    moves = (Move((0, 0), (0, 3)), Move((0, 1), (1, 3)))
    moved = ((0, 0), (0, 1), (2, 3))
    copy = rebalancer.copy_s(failed, job.layout.layers, moves, moved, job.layout.layers)
    assert copy == pytest.approx(2 * job.layout.stage_state_bytes[3] / job.hw.network_bandwidth)


def test_migrate_makes_the_fewest_moves_to_the_best_balance() -> None:
    job = small_job(4, 4, 8)
    rebalancer = Rebalancer(job, RebalanceParams("migrate"), lambda failed, layers: 1.0)
    work = [1.0, 1.0, 1.0, 1.0]
    moves, moved = rebalancer.migrate(((0, 2), (1, 2), (2, 2)), work)  # live 4, 4, 1, 4
    assert len(moves) == 2 and sorted(rebalancer.live(moved)) == [3, 3, 3, 4]
    assert all(move.target[1] == 2 for move in moves) and len(moved) == 3
    moves, moved = rebalancer.migrate(((0, 2), (1, 2), (2, 2), (0, 1), (1, 1)), work)  # live 4, 2, 1, 4
    assert len(moves) == 1 and sorted(rebalancer.live(moved)) == [2, 2, 3, 4]
    assert rebalancer.migrate(((0, 0), (1, 1)), work)[0] == ()  # already as balanced as 14 workers allow


def test_the_split_follows_the_live_workers() -> None:
    job = small_job(4, 4, 8)
    rebalancer = Rebalancer(job, RebalanceParams("repartition"), lambda failed, layers: 1.0)
    assert rebalancer.split([4, 4, 4, 4]) == job.layout.layers == (6, 6, 6, 6)
    split = rebalancer.split([4, 4, 4, 2])
    assert sum(split) == job.model.layers and min(split) >= 1 and split[3] < split[0]
    work = rebalancer.work(split)
    default = rebalancer.work(job.layout.layers)
    live = [4, 4, 4, 2]
    assert max(w / n for w, n in zip(work, live, strict=True)) < max(w / n for w, n in zip(default, live, strict=True))


def test_a_repartition_charges_the_layers_each_stage_gains() -> None:
    job = small_job(4, 4, 8)
    rebalancer = Rebalancer(job, RebalanceParams("repartition"), lambda failed, layers: 1.0)
    failed = ((0, 3), (1, 3))
    split = (7, 7, 6, 4)  # stage 0 gains layer 6, stage 1 gains 12 and 13, stage 2 gains 18 and 19
    copy = rebalancer.copy_s(failed, job.layout.layers, (), failed, split)
    per_layer = job.layout_for(split).layer_state_bytes / job.hw.network_bandwidth
    assert copy == pytest.approx(2 * 2 * per_layer)  # stage 2: 2 layers from stage 3's 2 survivors for 4 receivers
    recycle = _recycle("repartition", job)
    recycle.start(NODES16)
    phases = recycle.change(0.0, ["n3", "n7"], [])
    assert phases[2].what == "rebalance" and phases[2].duration > recycle.params.rebuild_s
    assert _live(recycle) == 14


def test_a_move_is_made_only_when_it_pays_over_the_expected_repair_time() -> None:
    assert pays(1.0, 0.8, 10.0, 3600.0, 0.01)
    assert not pays(1.0, 0.8, 10.0, 40.0, 0.01)  # (40 - 10) / 0.8 = 37.5 samples-worth < 40
    assert not pays(1.0, 0.995, 0.0, 1e9, 0.01)  # under the minimum gain
    impatient = _recycle("migrate", repair_prior_s=1.0)
    impatient.start(NODES16)
    impatient.change(0.0, ["n3", "n7"], [])
    assert impatient.reshapes == [] and _live(impatient) == 14


def test_repair_estimate_is_the_mean_time_between_arrivals() -> None:
    estimate = RepairEstimate(prior_s=100.0)
    assert estimate.expected_s(0.0) == 100.0 and estimate.expected_s(300.0) == 400.0
    estimate.arrived(3)
    assert estimate.expected_s(300.0) == 100.0
    with pytest.raises(ValueError, match="prior_s"):
        RepairEstimate(prior_s=0.0)


def test_no_move_while_spares_wait_or_when_off() -> None:
    spare = _recycle("migrate")
    spare.start([*NODES16, "s1"])
    spare.change(0.0, ["n3", "n7"], [])  # the spare re-joins stage 3; one slot there stays dead
    assert spare.reshapes == [] or spare.spares == []
    off = _recycle("off")
    off.start(NODES16)
    off.change(0.0, ["n3", "n7"], [])
    assert off.reshapes == [] and off.failed() == ((0, 3), (1, 3))


TRACE_NOISE = 0.02
"""What a re-shape may cost on a trace against the fixed grid: a move changes which stage a later
failure hits, which can cost a checkpoint fallback the fixed grid happened to escape. Measured
worst: none below 1.0 at this size (350M P=8 m=2); 2% allows for planner changes."""


@pytest.mark.parametrize("path", shipped_traces(), ids=lambda p: p.stem)
def test_rebalancing_never_slows_recycle_on_a_shipped_trace(path) -> None:
    trace = read_trace(path)
    job = Job(get_model("350M"), trace.peak // 8, 8, 2, failures_per_hour=trace.removals / (trace.duration / 3600))
    cache = PlanCache()
    rates = {}
    for mode in MODES:
        system = Recycle(job, RecycleParams(rebalance=RebalanceParams(mode)), cache)
        run = replay(system, trace.initial, trace.events, trace.duration)
        assert sum(e - s for s, e, _r in run.segments) == pytest.approx(trace.duration)
        rates[mode] = run.samples_per_s
    assert rates["migrate"] >= rates["off"] * (1 - TRACE_NOISE), rates
    assert rates["repartition"] >= rates["off"] * (1 - TRACE_NOISE), rates


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_rebalance_names_and_default() -> None:
    assert REBALANCE_NAMES == MODES and DEFAULT_REBALANCE in MODES
    argv = ["simulate", "sweep", "--model", "350M", "-D", "2", "-P", "2", "-m", "4", "--placement", "stage"]
    code, out, err = _cli(argv)
    assert code == 0, err
    assert f"ReCycle rebalancing: {DEFAULT_REBALANCE}" in out
    code, off, err = _cli([*argv, "--rebalance", "off"])
    assert code == 0 and "ReCycle rebalancing: off" in off, err


@pytest.mark.parametrize("value", ["foo", "", "Migrate", "none"])
def test_cli_bad_rebalance_is_refused_with_one_line(value: str) -> None:
    code, out, err = _cli(
        ["simulate", "sweep", "--model", "1.3B", "-D", "2", "-P", "2", "-m", "4", "--rebalance", value]
    )
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "--rebalance" in err and all(f"'{name}'" in err for name in MODES), err


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="off, migrate, repartition"):
        RebalanceParams("sideways")
    with pytest.raises(ValueError, match="min_gain"):
        RebalanceParams("migrate", min_gain=math.nan)
    with pytest.raises(ValueError, match="repair_prior_s"):
        RecycleParams(repair_prior_s=-1.0)
