"""Failures by cause (``sim/causes.py``): the Llama 3 mix, node-wide failures, drawn repair times."""

from __future__ import annotations

import math
import random

import pytest
from helpers import small_job

from ds_recycle.sim.causes import LLAMA3_CAUSES, REPAIR_MEAN_HOURS, FailureModel, cause_events
from ds_recycle.sim.experiments import ALL_SYSTEMS, poisson
from ds_recycle.sim.presets import RECYCLE_COSTS


def test_llama3_counts_are_the_419_interruptions() -> None:
    assert sum(c.count for c in LLAMA3_CAUSES) == 419
    shares = FailureModel().shares()
    assert shares["GPU HBM3 memory"] == pytest.approx(0.172, abs=5e-4)
    assert shares["network switch/cable"] == pytest.approx(0.084, abs=5e-4)
    node = sum(shares[c.name] for c in LLAMA3_CAUSES if c.scope == "node")
    assert node == pytest.approx(88 / 419)  # network 42, host 46


def test_cause_mix_and_node_wide_failures_come_out_as_specified() -> None:
    model = FailureModel()
    # 2,048 nodes of 8 one-GPU workers, failures rare enough that a node is almost always whole
    drawn = cause_events(16384, 0, 1, 3e-4, 24 * 60, model, seed=3)
    n = len(drawn.removed_per_failure)
    assert n > 5000
    for name, share in model.shares().items():
        sd = math.sqrt(share * (1 - share) / n)
        assert abs(drawn.by_cause[name] / n - share) < 4 * sd + 1e-9, name
    node_share = sum(c.count for c in LLAMA3_CAUSES if c.scope == "node") / 419
    multi = [k for k in drawn.removed_per_failure if k > 1]
    assert set(drawn.removed_per_failure) <= set(range(1, 9))
    assert sum(1 for k in multi if k == 8) >= 0.95 * len(multi)
    assert abs(len(multi) / n - node_share) < 4 * math.sqrt(node_share * (1 - node_share) / n) + 0.01
    # the GPUs of a node failure leave at one instant and are one node's
    removes = [e for e in drawn.events if e.kind == "remove"]
    by_time: dict[float, list[str]] = {}
    for e in removes:
        by_time.setdefault(e.time, []).append(e.node)
    whole = [names for names in by_time.values() if len(names) == 8]
    assert whole
    for names in whole:
        ids = sorted(int(x[1:]) for x in names)
        if ids[-1] < 16384:  # initial nodes: eight consecutive workers of one node
            assert ids[0] % 8 == 0 and ids == list(range(ids[0], ids[0] + 8))


def test_node_failure_takes_the_node_at_any_tp() -> None:
    model = FailureModel(causes=tuple(c for c in LLAMA3_CAUSES if c.scope == "node"))
    for tp, per_node in ((1, 8), (2, 4), (8, 1), (16, 1)):
        drawn = cause_events(1024, 0, tp, 1e-4, 10, model, seed=1)
        assert drawn.removed_per_failure and set(drawn.removed_per_failure) == {per_node}, tp


def test_repair_times_are_lognormal_with_the_class_mean() -> None:
    model = FailureModel()
    rng = random.Random(5)
    for kind, mean_h in REPAIR_MEAN_HOURS.items():
        draws = [model.draw_repair_s(kind, rng) for _ in range(20000)]
        assert sum(draws) / len(draws) == pytest.approx(mean_h * 3600, rel=0.06), kind
        median = sorted(draws)[len(draws) // 2]
        assert median == pytest.approx(mean_h * 3600 * math.exp(-(model.repair_sigma**2) / 2), rel=0.06), kind
    assert FailureModel(repair_sigma=0).draw_repair_s("host", rng) == REPAIR_MEAN_HOURS["host"] * 3600


def test_repaired_workers_come_back_after_their_repair() -> None:
    drawn = cause_events(512, 8, 1, 1e-4, 200, FailureModel(), seed=2)
    adds = [e for e in drawn.events if e.kind == "add"]
    removes = [e for e in drawn.events if e.kind == "remove"]
    assert adds and len(adds) <= len(removes) == sum(drawn.removed_per_failure)
    live = set(drawn.initial)
    for e in drawn.events:
        if e.kind == "remove":
            assert e.node in live
            live.remove(e.node)
        else:
            assert e.node not in live
            live.add(e.node)


@pytest.mark.parametrize("bad", [{"repair_sigma": -1.0}, {"gpus_per_node": 0}, {"causes": ()}])
def test_bad_failure_model(bad: dict) -> None:
    with pytest.raises(ValueError, match="failure model"):
        FailureModel(**bad)


def test_poisson_by_cause_runs_every_system() -> None:
    job = small_job(D=4, P=4, m=8)
    study = poisson(
        job, rate_multiple=2000, hours=24, spare_fraction=0.25, systems=ALL_SYSTEMS, failure_model=FailureModel()
    )
    entry = study.series[0]
    assert entry["failures"] == sum(entry["by_cause"].values()) > 0
    assert entry["workers_removed"] >= entry["failures"]
    for name in ALL_SYSTEMS:
        assert 0 < study.ettr(name) <= 1 + 1e-9, name


def test_recycle_cost_presets() -> None:
    assert RECYCLE_COSTS["paper"].detect_s == 5.0 and RECYCLE_COSTS["paper"].rebuild_s == 10.0
    measured = RECYCLE_COSTS["measured"]
    assert measured.detect_s + measured.rebuild_s < 5.0 and "[A]" in measured.source
