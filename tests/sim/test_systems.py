"""Each system's model on small hand-checked cases, and ReCycle against its references."""

from __future__ import annotations

import math
import random

import pytest
from helpers import balanced_job, small_job

from ds_recycle.planner.fault_free import fault_free_plan
from ds_recycle.planner.simulate import simulate
from ds_recycle.sim.bamboo import Bamboo, BambooParams, adopted_costs
from ds_recycle.sim.checkpoint import CheckpointParams, CheckpointRestart
from ds_recycle.sim.job import iteration_1f1b
from ds_recycle.sim.oobleck import Oobleck, OobleckParams, distribute
from ds_recycle.sim.recycle import Recycle
from ds_recycle.sim.timeline import Event, replay

NODES16 = [f"n{i}" for i in range(16)]


# ----- ReCycle ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("D", "P", "m"), [(2, 2, 4), (4, 4, 8), (3, 4, 4)])
def test_recycle_without_failure_is_the_fault_free_plan(D: int, P: int, m: int) -> None:
    job = small_job(D, P, m)
    recycle = Recycle(job)
    recycle.start([f"n{i}" for i in range(D * P)])
    plan = fault_free_plan(D, P, m, job.layout.costs, recycle.memory_cap)
    period = simulate(plan).steady_state_period / 1e3
    assert recycle.period(()) == pytest.approx(period, rel=1e-9)
    assert recycle.rate() == pytest.approx(job.global_batch / period * job.checkpoint_efficiency)


def _survivable(rng: random.Random, D: int, P: int, count: int) -> list[tuple[int, int]]:
    workers = [(p, s) for p in range(D) for s in range(P)]
    rng.shuffle(workers)
    chosen, per_stage = [], [0] * P
    for p, s in workers:
        if len(chosen) == count:
            break
        if per_stage[s] + 1 < D:
            per_stage[s] += 1
            chosen.append((p, s))
    return chosen


def test_recycle_sits_between_its_bound_and_rerouting_only() -> None:
    """With B + W equal to the fused backward, ReCycle's plan is never faster than the lower bound
    (iteration from idle) and never slower than re-routing on stock 1F1B."""
    rng = random.Random(7)
    for D, P, m in ((2, 4, 4), (4, 4, 8), (3, 2, 6)):
        job = balanced_job(D, P, m)
        recycle = Recycle(job)
        for f in range(0, D * (P - 1) // 2 + 1):
            failed = _survivable(rng, D, P, f)
            period, iteration, source = recycle.figures(failed)
            assert source == "plan"
            assert iteration >= recycle.bound_period(failed) * (1 - 1e-9)
            assert period <= recycle.rerouting_only_period(failed) * (1 + 1e-9), (D, P, m, failed)


HEURISTIC_SLACK = 1.03
"""The heuristic planner is not monotone: a plan for a failure set plus one more failure was
measured up to 2.05% faster than the plan for the set itself (D=4 P=4 m=8, 1.3B costs), i.e.
the smaller set's plan is that far from the best. A rise beyond 3% fails the test."""


def test_recycle_throughput_never_rises_as_failures_are_added() -> None:
    rng = random.Random(3)
    for D, P, m in ((4, 4, 8), (3, 4, 6), (4, 2, 4)):
        job = small_job(D, P, m)
        recycle = Recycle(job)
        for _ in range(4):
            order = _survivable(rng, D, P, D * P)
            previous = math.inf
            for f in range(len(order) + 1):
                period = recycle.period(order[:f])
                rate = job.global_batch / period
                assert rate <= previous * HEURISTIC_SLACK, (D, P, m, order[:f])
                previous = rate


def test_recycle_falls_back_to_a_checkpoint_when_a_stage_is_lost() -> None:
    job = small_job(2, 4, 8)
    recycle = Recycle(job, clock_offset=600.0)
    nodes = [f"n{i}" for i in range(8)]
    recycle.start(nodes)
    phases = recycle.change(0.0, ["n1"], [])
    assert [p.what for p in phases[:-1]] == ["lost work", "recover"]
    assert phases[-1].rate > 0 and "re-route" in recycle.notes
    phases = recycle.change(10.0, ["n5"], [])  # stage 1 of both pipelines: no survivor
    assert "checkpoint fallback" in recycle.notes
    assert phases[0].what == "lost work" and phases[0].duration == pytest.approx(600.0)
    assert phases[1].what == "restart" and phases[1].duration == job.checkpointing.restart_s
    assert recycle.failed() == ((1, 2), (1, 3))  # six live nodes packed pipeline by pipeline


def test_recycle_rejoin_fills_the_most_failed_stage_and_costs_a_state_copy() -> None:
    job = small_job(4, 4, 8)
    recycle = Recycle(job)
    recycle.start(NODES16)
    recycle.change(0.0, ["n1", "n5", "n2"], [])
    phases = recycle.change(100.0, [], ["new"])
    assert phases[0].what == "re-join"
    copy = job.layout.state_bytes / job.hw.network_bandwidth
    assert phases[0].duration == pytest.approx(copy + recycle.params.rebuild_s)
    assert recycle.slots[1] == "new"  # stage 1 had two failures


# ----- Oobleck ---------------------------------------------------------------------------------


def test_oobleck_survives_f_failures_and_f_plus_one_is_fatal() -> None:
    job = small_job(4, 4, 8)
    ok = Oobleck(job, OobleckParams(f=1), clock_offset=500.0)
    ok.start(NODES16)
    phases = ok.change(0.0, ["n3"], [])
    assert [p.what for p in phases[:-1]] == ["lost work", "reconfigure"]
    assert phases[1].duration == 57.0 and phases[-1].rate > 0
    fatal = Oobleck(job, OobleckParams(f=1), clock_offset=500.0)
    fatal.start(NODES16)
    phases = fatal.change(0.0, ["n3", "n7"], [])
    assert "fatal: checkpoint restart" in fatal.notes
    assert phases[0].duration == pytest.approx(500.0) and phases[1].what == "restart"


def test_oobleck_deals_nodes_over_heterogeneous_pipelines() -> None:
    job = small_job(4, 4, 8)
    oobleck = Oobleck(job)
    oobleck.start(NODES16[:14])
    assert sorted(oobleck.sizes()) == [3, 3, 4, 4]
    full = Oobleck(job)
    full.start(NODES16)
    assert full.iteration() == pytest.approx(iteration_1f1b(job, 4, 8, 4))
    assert oobleck.rate() < full.rate()
    rates = []
    for live in range(16, 0, -1):
        system = Oobleck(job)
        system.start(NODES16[:live])
        rates.append(system.rate())
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False)), rates


def test_distribute_matches_brute_force() -> None:
    def time(n: int, b: int) -> float:
        return (b + n - 1) * (10.0 / n) if b else 0.0

    for classes, total in (({3: 1, 4: 3}, 32), ({2: 2, 3: 1}, 7), ({5: 1}, 9)):
        sizes = [n for n, c in classes.items() for _ in range(c)]
        best = math.inf
        for split in _splits(total, len(sizes)):
            best = min(best, max(time(n, b) for n, b in zip(sizes, split, strict=True)))
        assert distribute(total, classes, time) == pytest.approx(best)


def _splits(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _splits(total - first, parts - 1):
            yield (first, *rest)


# ----- Bamboo ----------------------------------------------------------------------------------


def test_bamboo_layout_is_deeper_and_a_failover_slows_it() -> None:
    job = small_job(4, 4, 8)
    bamboo = Bamboo(job)
    bamboo.start(NODES16)
    assert bamboo.depth == 6 and len(bamboo.pipes) == 2 and len(bamboo.standby) == 4
    before = bamboo.rate()
    bamboo.params = BambooParams(overload_threshold=1.0)  # keep it in failover
    object.__setattr__(bamboo, "standby", [])
    phases = bamboo.change(0.0, ["n2"], [])
    assert "failover" in bamboo.notes and phases[0].what == "lost work"
    assert 0 < phases[-1].rate < before


def test_bamboo_adjacent_failures_are_fatal() -> None:
    job = small_job(4, 4, 8)
    for removals in ([["n2", "n3"]], [["n3"], ["n2"]], [["n0", "n5"]]):
        bamboo = Bamboo(job, BambooParams(overload_threshold=1.0), clock_offset=300.0)
        bamboo.start(NODES16[:12])
        for i, group in enumerate(removals):
            phases = bamboo.change(float(i), group, [])
        assert "fatal: checkpoint restart" in bamboo.notes, removals
        assert phases[0].what == "lost work"


def test_bamboo_non_adjacent_failures_are_not_fatal() -> None:
    bamboo = Bamboo(small_job(4, 4, 8), BambooParams(overload_threshold=1.0))
    bamboo.start(NODES16[:12])
    bamboo.change(0.0, ["n1", "n3"], [])
    assert "fatal: checkpoint restart" not in bamboo.notes


def test_bamboo_runs_out_of_memory_where_redundancy_does_not_fit() -> None:
    job = small_job(2, 4, 8, model="13B")
    bamboo = Bamboo(job, BambooParams(depth_factor=1.0))
    bamboo.start([f"n{i}" for i in range(8)])
    assert bamboo.rate() == 0.0 and "out of memory" in bamboo.notes


def test_adopted_costs_merge_into_the_predecessor() -> None:
    costs = small_job(4, 4, 8).costs_for(4, 1).fused
    merged = adopted_costs(costs, (False, True, False, False))
    assert merged.stages == 3 and merged.F[0] == pytest.approx(costs.F[0] + costs.F[1])
    wrapped = adopted_costs(costs, (True, False, False, False))
    assert wrapped.F[-1] == pytest.approx(costs.F[3] + costs.F[0])


# ----- checkpoint-restart ----------------------------------------------------------------------


def test_checkpoint_restart_loses_at_most_one_interval() -> None:
    job = small_job(4, 4, 8, interval=1000.0)
    rng = random.Random(1)
    system = CheckpointRestart(job)
    live = list(NODES16)
    system.start(live)
    now, serial = 0.0, 16
    for _ in range(30):
        now += rng.uniform(0, 3000)
        victim = rng.choice(system.active) if system.active else live[0]
        added = [f"x{serial}"]
        serial += 1
        expected = system.clock.lost(now)
        phases = system.change(now, [victim], added)
        lost = [p for p in phases if p.what == "lost work"]
        assert lost and lost[0].duration == pytest.approx(expected)
        assert 0 <= lost[0].duration <= job.checkpoint_interval


def test_checkpoint_restart_redoes_the_same_work_after_a_failure_during_its_restart() -> None:
    """A failure during the restart or the redo cancels it: the job restarts again and redoes the
    same work (no checkpoint was reached); the redo counts towards the next checkpoint."""
    job = small_job(4, 4, 8, interval=1000.0)
    nodes = [f"n{i}" for i in range(18)]  # two spares keep four pipelines
    R = job.checkpointing.restart_s
    events = [Event(400.0, "remove", "n0"), Event(600.0, "remove", "n1")]
    run = replay(CheckpointRestart(job), nodes, events, 5000.0)
    rate = CheckpointRestart(job).start(NODES16)[-1].rate
    # the second failure comes during the first restart: from it, R + the same 400 s redo
    assert run.downtime == pytest.approx(200.0 + R + 400.0)
    assert run.samples == pytest.approx(rate * (5000.0 - run.downtime))
    # a failure 100 s after the redo loses the 400 s again plus those 100 s: the checkpoint at 1000 s
    # of work is not reached yet
    system = CheckpointRestart(job)
    system.start(nodes)
    system.change(400.0, ["n0"], [])
    end = 400.0 + R + 400.0
    phases = system.change(end + 100.0, ["n1"], [])
    assert [p.what for p in phases[:2]] == ["restart", "lost work"]
    assert phases[1].duration == pytest.approx(500.0)
    # past that checkpoint only the work since it is lost
    system.change(end + 100.0 + R + 500.0 + 700.0, ["n2"], [])
    assert system._pending[1].duration == pytest.approx(500.0 + 700.0 - 1000.0)


def test_checkpoint_restart_makes_no_progress_when_failures_outpace_restarts() -> None:
    job = small_job(4, 4, 8, interval=1000.0)
    nodes = [f"n{i}" for i in range(16 + 40)]
    R = job.checkpointing.restart_s
    events = [Event(500.0 + k * (R + 100.0), "remove", f"n{k}") for k in range(30)]  # always a working node
    horizon = events[-1].time
    run = replay(CheckpointRestart(job), nodes, events, horizon)
    rate = CheckpointRestart(job).start(NODES16)[-1].rate
    assert run.samples == pytest.approx(rate * 500.0)


def test_checkpoint_restart_shrinks_or_waits() -> None:
    job = small_job(4, 4, 8)
    shrink = CheckpointRestart(job)
    shrink.start(NODES16)
    shrink.change(0.0, ["n0"], [])
    assert shrink.pipelines == 3 and 0 < shrink.rate() < job.global_batch / iteration_1f1b(job, 4, 8, 4)
    wait = CheckpointRestart(job, CheckpointParams("wait"))
    wait.start(NODES16)
    wait.change(0.0, ["n0"], [])
    assert wait.rate() == 0.0
    phases = wait.change(50.0, [], ["spare"])
    assert phases[0].what == "restart" and wait.pipelines == 4
