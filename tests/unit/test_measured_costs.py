"""Measured costs without processes: op times, the agreed profile, and the cost tracker's decisions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ds_recycle.config import ProfileConfig, RecycleConfig, RecycleConfigError, StragglerConfig, TimingEmulation
from ds_recycle.engine.profile import ROW, AgreedProfile, CostTracker, OpTimes, agree, exchange
from ds_recycle.engine.timing import InstructionEvent
from ds_recycle.planner.plan import CostModel


def events(f: float, b: float, w: float, s: float = 1.0, n: int = 4) -> list[InstructionEvent]:
    out, t = [], 0.0
    for kind, ms in (("ForwardPass", f), ("BackwardInput", b), ("BackwardWeight", w)):
        for k in range(n):
            out.append(InstructionEvent(kind, 0, k, t, t + ms / 1000))
            t += 1
    out.append(InstructionEvent("StaggeredStep", -1, -1, t, t + s / 1000))
    out.append(InstructionEvent("RecvActivation", 0, 0, t, t + 5))  # not an op of the profile
    return out


def table(rows: dict[tuple[int, int], tuple[float, float, float]], D: int, P: int) -> list[list[float]]:
    out = [[0.0] * ROW for _ in range(D * P)]
    for (p, s), (f, b, w) in rows.items():
        times = OpTimes(2)
        times.record(events(f, b, w))
        out[p * P + s] = times.row()
    return out


def uniform_rows(D: int, P: int, f=10.0, b=10.0, w=5.0, **override) -> dict:
    rows = {(p, s): (f, b, w) for p in range(D) for s in range(P)}
    rows.update(override.get("rows", {}))
    return rows


def test_op_times_keep_a_window_of_iterations():
    times = OpTimes(2)
    assert times.row() == [0.0] * ROW
    times.record(events(10, 20, 30))
    times.record(events(12, 20, 30))
    times.record(events(14, 20, 30))
    row = times.row()
    assert row[:4] == pytest.approx([13, 20, 30, 1])
    assert row[4] == pytest.approx(12)  # F's lower quartile
    assert row[-1] == 2


def test_exchange_sums_rows_exactly():
    seen = []
    result = exchange([1.5] * ROW, (1, 0), 2, 2, seen.append)
    assert len(seen) == 1 and result[2] == [1.5] * ROW and result[0] == [0.0] * ROW


def test_the_agreed_profile_ignores_one_slow_replica_and_names_it():
    rows = uniform_rows(4, 2, rows={(2, 1): (20.0, 20.0, 10.0)})
    profile = AgreedProfile.from_table(table(rows, 4, 2), 4, 2)
    assert profile.F == {0: 10.0, 1: 10.0} and profile.W == {0: 5.0, 1: 5.0}
    assert profile.slowdown[(2, 1)] == pytest.approx(2.0)
    assert profile.slowdown[(0, 1)] == pytest.approx(1.0)
    # a missing worker (failed, or a joiner in its warm-up) has no row and no slowdown
    rows.pop((3, 0))
    assert (3, 0) not in AgreedProfile.from_table(table(rows, 4, 2), 4, 2).slowdown


def test_a_slowdown_is_judged_only_over_a_full_window_of_the_worker_and_its_peers():
    rows = table(uniform_rows(2, 2, rows={(1, 1): (20.0, 20.0, 10.0)}), 2, 2)  # one iteration each
    assert AgreedProfile.from_table(rows, 2, 2, judged_after=1).slowdown[(1, 1)] == pytest.approx(2.0)
    short = AgreedProfile.from_table(rows, 2, 2, judged_after=2)
    assert short.slowdown == {} and short.F == {0: 10.0, 1: 10.0}, "costs are taken, slowdowns are not"
    longer = OpTimes(2)
    for _ in range(2):
        longer.record(events(20.0, 20.0, 10.0))
    rows[1 * 2 + 1] = longer.row()
    assert AgreedProfile.from_table(rows, 2, 2, judged_after=2).slowdown == {}, "its peer spans one iteration"


def tracker(base: CostModel | None = None, measured: bool = True, **straggler) -> CostTracker:
    config = StragglerConfig(**{"threshold": 1.3, "patience": 2, **straggler})
    return CostTracker(base or CostModel.uniform(2, 10, 10, 5), ProfileConfig(), config, measured=measured)


def test_unit_costs_take_the_first_complete_profile_then_only_a_drift():
    costs = tracker(CostModel.uniform(2), measured=False)
    decision = costs.update(AgreedProfile.from_table(table(uniform_rows(2, 2), 2, 2), 2, 2))
    assert decision.costs == CostModel.uniform(2, 10, 10, 5, step=1.0)
    assert costs.update(AgreedProfile.from_table(table(uniform_rows(2, 2, f=10.5), 2, 2), 2, 2)).costs is None
    slower = AgreedProfile.from_table(table(uniform_rows(2, 2, f=12), 2, 2), 2, 2)
    assert costs.update(slower).costs is None  # one agreement beyond the drift: a delayed op maybe
    assert costs.update(AgreedProfile.from_table(table(uniform_rows(2, 2), 2, 2), 2, 2)).costs is None
    assert costs.update(slower).costs is None
    drift = costs.update(slower)  # two in a row
    assert drift.costs.F == (12.0, 12.0) and "drifted 20%" in drift.reasons[0]


def test_emulated_costs_within_the_drift_are_kept():
    costs = tracker()
    assert costs.update(AgreedProfile.from_table(table(uniform_rows(2, 2, f=10.4), 2, 2), 2, 2)).costs is None


def test_a_straggler_is_planned_after_patience_and_released_below_the_release_level():
    costs = tracker()
    slow = AgreedProfile.from_table(table(uniform_rows(2, 2, rows={(1, 1): (20, 20, 10)}), 2, 2), 2, 2)
    assert costs.update(slow).changes == []
    decision = costs.update(slow)
    assert [(c.worker, c.detected) for c in decision.changes] == [((1, 1), True)]
    assert decision.costs.stragglers() == {(1, 1): 2.0}
    assert decision.costs.F == (10.0, 10.0)  # its stage's cost is its peer's
    middling = AgreedProfile.from_table(table(uniform_rows(2, 2, rows={(1, 1): (12, 12, 6)}), 2, 2), 2, 2)
    assert costs.update(middling).costs is None  # 1.2x: between the release level (1.15) and 1.3: kept
    assert costs.in_use.stragglers() == {(1, 1): 2.0}
    well = AgreedProfile.from_table(table(uniform_rows(2, 2), 2, 2), 2, 2)
    assert costs.update(well).costs is None
    released = costs.update(well)
    assert [(c.worker, c.detected) for c in released.changes] == [((1, 1), False)]
    assert released.costs.slow == ()


def test_a_straggler_whose_peers_failed_is_kept_and_sets_no_stage_cost():
    costs = tracker()
    slow = AgreedProfile.from_table(table(uniform_rows(2, 2, rows={(1, 1): (20, 20, 10)}), 2, 2), 2, 2)
    costs.update(slow)
    costs.update(slow)
    assert costs.in_use.stragglers() == {(1, 1): 2.0}
    alone = uniform_rows(2, 2, rows={(1, 1): (20, 20, 10)})
    alone.pop((0, 1))  # its only peer failed
    profile = AgreedProfile.from_table(table(alone, 2, 2), 2, 2, costs.stragglers)
    assert (1, 1) not in profile.slowdown
    assert (profile.F[1], profile.B[1], profile.W[1]) == (10.0, 10.0, 5.0)  # its own, divided by its factor
    for _ in range(3):
        assert costs.update(profile).costs is None
    assert costs.in_use.stragglers() == {(1, 1): 2.0}


def test_stragglers_off_or_outside_the_handled_stages_are_not_planned():
    slow = AgreedProfile.from_table(table(uniform_rows(2, 3, rows={(1, 0): (30, 30, 15)}), 2, 3), 2, 3)
    off = CostTracker(CostModel.uniform(3, 10, 10, 5), ProfileConfig(), StragglerConfig(enabled=False), True)
    inner = CostTracker(CostModel.uniform(3, 10, 10, 5), ProfileConfig(), StragglerConfig(), True, [1])
    for costs in (off, inner):
        for _ in range(3):
            assert costs.update(slow).costs is None


def test_config_keys():
    config = RecycleConfig.from_section(
        {
            "emulate_timing": {"F": [1, 2], "B": 3, "W": [4, 5], "slowdown": [[1, 0, 2]]},
            "profile": {"warmup": 3, "window": 5, "interval": 2, "drift": 0.2},
            "stragglers": {"threshold": 1.5, "patience": 3},
        }
    )
    timing = config.emulate_timing
    assert timing == TimingEmulation((1.0, 2.0), 3.0, (4.0, 5.0), ((1, 0, 2.0),))
    assert timing.seconds("BW", 1) == pytest.approx(0.008) and timing.factor(1, 0) == 2.0
    assert config.profile == ProfileConfig(True, 3, 5, 2, 0.2)
    assert config.stragglers == StragglerConfig(True, 1.5, 3)
    assert RecycleConfig.from_section({"stragglers": False}).stragglers.enabled is False
    assert RecycleConfig.from_section({"profile": False}).profile.enabled is False
    with pytest.raises(RecycleConfigError, match="has 2 values but the pipeline has 3 stages"):
        timing.check_topology(2, 3)
    with pytest.raises(RecycleConfigError, match=r"slowdown names worker \(pipeline 1, stage 0\), outside"):
        timing.check_topology(1, 2)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"emulate_timing": {"F": [], "B": 1, "W": 1}}, "recycle.emulate_timing.F must be a number of milliseconds"),
        ({"emulate_timing": {"F": [1, 2], "B": [1], "W": 1}}, "must have one length"),
        ({"emulate_timing": {"F": 1, "B": 1, "W": 1, "slowdown": [[0, 0]]}}, "recycle.emulate_timing.slowdown must be"),
        ({"emulate_timing": {"F": 1, "B": 1, "W": 1, "slowdown": [[0, 0, 0.5]]}}, "factor a number in [1, 100]"),
        ({"emulate_timing": {"F": 1, "B": 1, "W": 1, "slowdown": [[0, 0, 2], [0, 0, 3]]}}, "twice"),
        (
            {"emulate_timing": {"F": 1, "B": 1, "W": 1, "planner_costs": "x"}},
            "planner_costs must be one of emulated, unit",
        ),
        ({"profile": {"warmup": -1}}, "recycle.profile.warmup must be an integer"),
        ({"profile": {"drift": 0}}, "recycle.profile.drift must be a fraction"),
        ({"profile": {"windows": 2}}, "unknown key recycle.profile.windows; allowed keys: enabled, warmup, window"),
        ({"profile": "on"}, "recycle.profile must be true, false or an object"),
        ({"stragglers": {"threshold": 1.0}}, "recycle.stragglers.threshold must be a number in (1, 100]"),
        ({"stragglers": {"patience": 0}}, "recycle.stragglers.patience must be an integer"),
        ({"stragglers": {"enabled": "yes"}}, "recycle.stragglers.enabled must be true or false"),
        ({"stragglers": 1.3}, "recycle.stragglers must be true, false or an object"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(section, message):
    with pytest.raises(RecycleConfigError) as err:
        RecycleConfig.from_section(section)
    assert message in str(err.value)


class FakeWorld:
    """An all-reduce (sum) among threads, one per rank."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks)
        self.tensors: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        with self.lock:
            self.tensors[rank] = tensor.clone()
        self.barrier.wait()
        total = sum(self.tensors.values())
        self.barrier.wait()
        tensor.copy_(total)


def test_agreement_hands_the_state_to_a_joiner_and_heals_a_rank_one_update_ahead():
    D, P = 2, 2
    rows = {(p, s): (10.0, 10.0, 5.0) for p in range(D) for s in range(P)}
    rows[(1, 1)] = (25.0, 25.0, 12.5)
    trackers = {w: tracker() for w in rows}
    for costs in trackers.values():  # two agreements everyone took part in: (1, 1) is planned as a straggler
        for _ in range(2):
            costs.update(AgreedProfile.from_table(table(rows, D, P), D, P))
    assert trackers[(0, 0)].in_use.stragglers() == {(1, 1): 2.5}
    trackers[(0, 1)] = tracker()  # a joiner: fresh state
    trackers[(1, 0)].update(AgreedProfile.from_table(table(rows, D, P), D, P))  # one ahead
    world = FakeWorld(D * P)
    results: dict = {}

    def run(rank: int, worker) -> None:
        times = OpTimes(2)
        times.record(events(*rows[worker]))
        reduce = lambda t: world.all_reduce(rank, t)  # noqa: E731
        profile = agree(trackers[worker], times.row(), worker, D, P, reduce)
        results[worker] = (profile, trackers[worker].update(profile).costs, trackers[worker].state(D))

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(rows)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(results) == D * P
    profiles, _decisions, states = zip(*results.values(), strict=True)
    assert all(p == profiles[0] for p in profiles) and all(s == states[0] for s in states)
    assert all(t.in_use == trackers[(0, 0)].in_use for t in trackers.values())
    assert trackers[(0, 1)].in_use.stragglers() == {(1, 1): 2.5}


def test_tracker_state_round_trips():
    costs = tracker(CostModel((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), 0.5, 7.0, ((1, 0, 1.5),)))
    costs.above[(0, 1)] = 1
    costs.exchanges = 3
    other = tracker()
    other.load_state(costs.state(2), 2)
    assert other.in_use == costs.in_use and other.above == {(0, 1): 1} and other.exchanges == 3
    assert other.stragglers == {(1, 0): 1.5}


def test_emulation_pads_each_stage_and_a_straggler_by_its_factor():
    from ds_recycle.engine.timing import pad_to
    from ds_recycle.planner.actions import BackwardWeight, ForwardPass

    timing = TimingEmulation((10.0, 20.0), 10.0, 0.0, ((1, 1, 2.0),))
    for instruction, worker, want in (
        (ForwardPass(0, home=0, mb=0), (0, 1), 0.020),
        (ForwardPass(0, home=0, mb=0), (1, 1), 0.040),
        (BackwardWeight(0, home=0, mb=0), (0, 0), 0.0),
    ):
        began = time.time()
        pad_to(instruction, began, timing, worker)
        assert want <= time.time() - began < want + 0.05  # a busy host may wake a sleep late
