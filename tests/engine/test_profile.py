"""Measured costs on real DeepSpeed engines in real processes on gloo (issue 18 items 1 and 4).

One launch of P=2 x D=2 ranks runs, from one seed and one map-style dataset, with emulated timing:
a reference (no profile, no straggler handling), a run whose second stage gets slower mid-run (a
drift re-plans), and a run with a straggler at 2.5x that recovers (detected, routed around,
released). Every rank must hold the same cost model at every iteration, and every run must train
exactly as the reference: every micro-batch once per stage and iteration, every parameter equal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_recycle.planner.plan import CostModel
from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import ds_config

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("profile_worker.py")
PP, DP, M, STEPS = 2, 2, 4, 12
CLIP = 1.0
TIMING = {"F": 6, "B": 6, "W": 6}
PROFILE = {"warmup": 2, "window": 2, "interval": 1, "drift": 0.1}
STRAGGLERS = {"enabled": True, "threshold": 1.3, "patience": 2}


def recycle(**overrides) -> dict:
    return {"enabled": True, "emulate_timing": TIMING, "profile": PROFILE, "stragglers": STRAGGLERS, **overrides}


RUNS = [
    {
        "name": "reference",
        "steps": STEPS,
        "config": ds_config(M, CLIP, recycle(profile=False, stragglers=False)),
    },
    {
        "name": "drift",
        "steps": STEPS,
        "config": ds_config(M, CLIP, recycle()),
        "switch": {"5": {"F": [6, 9], "B": [6, 9], "W": [6, 9]}},
    },
    {
        "name": "straggler",
        "steps": STEPS,
        "config": ds_config(M, CLIP, recycle(emulate_timing={**TIMING, "slowdown": [[1, 1, 2.5]]})),
        "switch": {"6": TIMING},
    },
]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("profile")
    (tmp / "runs.json").write_text(json.dumps(RUNS))
    results = launch(
        [str(WORKER), "--pp", str(PP), "--runs", str(tmp / "runs.json"), "--out", str(tmp / "out")],
        world_size=PP * DP,
        timeout=240,
        log_dir=tmp / "logs",
        preload=PRELOAD_MODULES,
        membership=False,
    )
    failed = [r for r in results if not r.ok]
    if failed:
        sys.stderr.write(failed[0].log[-6000:])
        raise AssertionError(f"rank {failed[0].rank} exited with {failed[0].returncode}; its log is above")
    return {
        run["name"]: [torch.load(tmp / "out" / run["name"] / f"rank{rank}.pt") for rank in range(PP * DP)]
        for run in RUNS
    }


def assert_trains_as_reference(reference: list[dict], run: list[dict]) -> None:
    for want, got in zip(reference, run, strict=True):
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    forwards = sorted(entry for dump in run for entry in dump["ledger"])
    expected = sorted((i, h, k, s) for i in range(STEPS) for h in range(DP) for k in range(M) for s in range(PP))
    assert forwards == expected


def assert_agreed(run: list[dict]) -> None:
    """Every rank holds the identical cost model at every iteration, and logged the same changes."""
    for dump in run[1:]:
        assert dump["costs"] == run[0]["costs"]
        assert dump["changes"] == run[0]["changes"]
        assert dump["gives"] == run[0]["gives"]


def test_the_reference_keeps_the_emulated_costs(dumps):
    reference = dumps["reference"]
    assert all(dump["changes"] == [] for dump in reference)
    assert reference[0]["costs"][-1]["F"] == [6.0, 6.0]


def test_a_drift_re_plans_on_every_rank_at_one_iteration(dumps):
    run = dumps["drift"]
    assert_agreed(run)
    # the second stage at 1.5x from iteration 5: re-planned once the window holds it. (Before,
    # the emulated costs are within 10% of the measured ones, but a host shared with other jobs
    # may delay ops enough to re-plan earlier too: not asserted.)
    after = [c for c in run[0]["changes"] if c["iteration"] > 5 and any("drifted" in r for r in c["reasons"])]
    assert after, run[0]["changes"]
    assert after[0]["iteration"] <= 9  # the window holds it from 7, two agreements in a row
    final = CostModel.from_dict(run[0]["costs"][-1])
    assert final.B[1] / final.B[0] == pytest.approx(1.5, rel=0.1)
    assert final.W[1] / final.W[0] == pytest.approx(1.5, rel=0.1)
    assert after[0]["predicted"] >= after[0]["fault_free"] - 1e-6
    assert_trains_as_reference(dumps["reference"], run)


def test_a_straggler_is_detected_routed_around_and_released(dumps):
    run = dumps["straggler"]
    assert_agreed(run)
    changes = [c for c in run[0]["changes"] if c["changes"]]
    detected = [c for c in changes if c["changes"][0]["detected"]]
    released = [c for c in changes if not c["changes"][0]["detected"]]
    assert detected and released, run[0]["changes"]
    first = detected[0]
    assert first["changes"][0]["worker"] == (1, 1)
    assert first["changes"][0]["slowdown"] == pytest.approx(2.5, rel=0.25)  # 2.1 measured on a loaded CI
    assert first["iteration"] <= 6  # warm-up 2, then two agreements above the threshold
    assert first["predicted"] < first["doing_nothing"]
    gives = run[0]["gives"]
    handed = [i for i, give in enumerate(gives) if give.get("1,1", 0) > 0]
    assert handed, gives
    assert released[0]["iteration"] > first["iteration"]
    assert gives[-1] == {}
    assert run[0]["costs"][-1].get("slow") is None
    # the straggler ran fewer of its own micro-batches while it was planned around
    ledger = [entry for dump in run if tuple(dump["worker"]) == (1, 1) for entry in dump["ledger"]]
    assert any(sum(1 for e in ledger if e[0] == i) < M for i in handed)
    assert_trains_as_reference(dumps["reference"], run)
    evaluated = [dump["evaluated"] for dump in run]
    assert all(evaluated), "every rank evaluates (from an iterator) while the straggler is planned around"
    assert all(torch.isfinite(torch.tensor(loss)) for e in evaluated for _, loss in e)
