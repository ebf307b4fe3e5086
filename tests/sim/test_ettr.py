"""ETTR, the replica-restart and job-restart baselines, and ``ds-recycle simulate ettr``."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers import small_job

from ds_recycle.cli import main
from ds_recycle.sim.ettr import META_MTTF_HOURS, failures_per_hour
from ds_recycle.sim.experiments import ALL_SYSTEMS, SystemParams, ettr, fault_free_rate, poisson
from ds_recycle.sim.job_restart import JobRestart
from ds_recycle.sim.recycle import Recycle, RecycleParams
from ds_recycle.sim.replica_restart import ReplicaRestart
from ds_recycle.sim.timeline import Event, Run, replay


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _rate_at(run: Run, t: float) -> float:
    return next(rate for start, end, rate in run.segments if start <= t < end)


def _conserved(run: Run, horizon: float) -> None:
    assert run.segments[0][0] == 0 and run.segments[-1][1] == pytest.approx(horizon)
    for (_a, end, _r), (start, _b, _s) in zip(run.segments, run.segments[1:], strict=False):
        assert start == pytest.approx(end)
    assert sum((e - s) * r for s, e, r in run.segments) == pytest.approx(run.samples, rel=1e-9)


def test_ettr_is_one_without_failures() -> None:
    job = small_job(D=4, P=4, m=8)
    study = poisson(job, rate_multiple=0.0, hours=6, systems=ALL_SYSTEMS)
    assert study.series[0]["failures"] == 0
    for name in ALL_SYSTEMS:
        assert study.ettr(name) == pytest.approx(1.0, abs=1e-9), name


def test_ettr_of_a_run() -> None:
    run = Run("x", 100.0, samples=450.0)
    assert ettr(run, 5.0) == pytest.approx(0.9)
    assert ettr(run, 0.0) == 0.0


def test_ettr_decreases_with_the_failure_rate() -> None:
    job = small_job(D=4, P=4, m=8)
    low = poisson(job, rate_multiple=200, hours=48, repair_hours=1, spare_fraction=0.25, systems=ALL_SYSTEMS)
    high = poisson(job, rate_multiple=2000, hours=48, repair_hours=1, spare_fraction=0.25, systems=ALL_SYSTEMS)
    assert 0 < low.series[0]["failures"] < high.series[0]["failures"]
    for name in ALL_SYSTEMS:
        assert 0 < high.ettr(name) < low.ettr(name) <= 1.0 + 1e-9, name


def test_replica_restart_keeps_the_other_replicas_during_a_restart() -> None:
    job = small_job(D=4, P=4, m=8)
    nodes = [f"n{i}" for i in range(job.workers + 1)]  # one spare
    system = ReplicaRestart(job)
    full = system.full_rate
    run = replay(system, nodes, [Event(1000.0, "remove", "n5")], 4000.0)
    _conserved(run, 4000.0)
    assert _rate_at(run, 500.0) == pytest.approx(full)
    pause = system.params.detect_s + system.params.lost_iteration_fraction * job.global_batch / full * (
        job.checkpoint_efficiency
    )
    assert _rate_at(run, 1000.0 + pause / 2) == 0.0
    assert _rate_at(run, 1000.0 + pause + 1) == pytest.approx(full * 3 / 4)
    assert _rate_at(run, 1000.0 + system.params.restart_s - 1) == pytest.approx(full * 3 / 4)
    assert _rate_at(run, 1000.0 + system.params.restart_s + 1) == pytest.approx(full)
    assert run.downtime == pytest.approx(pause)


def test_replica_restart_waits_for_a_node_without_spares() -> None:
    job = small_job(D=4, P=4, m=8)
    nodes = [f"n{i}" for i in range(job.workers)]
    system = ReplicaRestart(job)
    events = [Event(100.0, "remove", "n0"), Event(200.0, "remove", "n15"), Event(2000.0, "add", "m0")]
    run = replay(system, nodes, events, 5000.0)
    _conserved(run, 5000.0)
    full = system.full_rate
    assert _rate_at(run, 1000.0) == pytest.approx(full / 2)
    assert _rate_at(run, 2000.0 + system.params.restart_s / 2) == pytest.approx(full / 2)
    assert _rate_at(run, 2000.0 + system.params.restart_s + 1) == pytest.approx(full * 3 / 4)


def test_replica_restart_returns_on_time_when_failures_overlap() -> None:
    """The second failure's pause and rate drop wait for the first restart's pending phase (the
    replay keeps it); the replicas still come back at their own ready times."""
    job = small_job(D=4, P=4, m=8)
    nodes = [f"n{i}" for i in range(job.workers + 2)]
    system = ReplicaRestart(job)
    run = replay(system, nodes, [Event(100.0, "remove", "n0"), Event(150.0, "remove", "n4")], 1000.0)
    _conserved(run, 1000.0)
    full, restart = system.full_rate, system.params.restart_s
    assert _rate_at(run, 120.0) == pytest.approx(full * 3 / 4)
    assert _rate_at(run, 150.0 + restart - 1) == pytest.approx(full * 3 / 4)
    assert _rate_at(run, 150.0 + restart + 1) == pytest.approx(full)
    running = full * (1000.0 - run.downtime)
    # exact: two replica shares lost for a restart each; counted: at most one restart's share too many
    assert running - full / 4 * 2 * restart <= run.samples <= running - full / 4 * restart


def test_job_restart_loses_the_restart_and_at_most_one_step_per_failure() -> None:
    job = small_job(D=4, P=4, m=8)
    nodes = [f"n{i}" for i in range(job.workers + 3)]
    system = JobRestart(job)
    restart = system.params.restart_s
    events = [Event(t, "remove", f"n{i}") for t, i in ((1000.0, 2), (3000.0, 7), (6000.0, 13))]
    run = replay(system, nodes, events, 10000.0)
    full, iteration = system.rate(), system.iteration()  # three spares replaced the failed nodes
    _conserved(run, 10000.0)
    assert run.notes.count("job restart") == 3
    assert 3 * restart < run.downtime <= 3 * (restart + iteration)
    assert run.pauses["lost work"] <= 3 * iteration
    assert run.samples == pytest.approx(full * (10000.0 - run.downtime))
    assert _rate_at(run, 1000.0 + restart + iteration + 1) == pytest.approx(full)


def test_new_systems_conserve_time_under_many_failures() -> None:
    job = small_job(D=4, P=4, m=8)
    study = poisson(job, rate_multiple=3000, hours=24, repair_hours=2, systems=("replica-restart", "job-restart"))
    for name in ("replica-restart", "job-restart"):
        run = study.runs[name]
        assert 0 <= run.samples <= study.fault_free[name] * run.duration * (1 + 1e-9)
    assert study.fault_free["replica-restart"] == pytest.approx(
        fault_free_rate("checkpoint", job, SystemParams(), [f"n{i}" for i in range(job.workers)])
    )


def test_meta_rate_preset() -> None:
    for gpus, hours in META_MTTF_HOURS.items():
        assert failures_per_hour("meta", gpus) == pytest.approx(1 / hours)
    assert failures_per_hour("meta", 1024) < failures_per_hour("meta", 4096) < failures_per_hour("meta", 16384)
    with pytest.raises(ValueError, match="meta, llama3"):
        failures_per_hour("google", 1024)


def test_poisson_table_has_an_ettr_column() -> None:
    code, out, err = _cli(["simulate", "poisson", "--model", "13B", "--gpus", "64", "-P", "4", "--hours", "24"])
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("system"))
    assert "ETTR" in header.split()


def test_cli_ettr_prints_a_row_per_scale_and_a_png(tmp_path) -> None:
    png = tmp_path / "ettr.png"
    argv = ["simulate", "ettr", "--model", "13B", "--tp", "8", "-P", "8", "--hours", "2", "--plot", str(png)]
    code, out, err = _cli(argv)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["meta"], ["llama3"])]
    assert [(r[0], int(r[1])) for r in rows] == [(p, g) for p in ("meta", "llama3") for g in (1024, 16384, 131072)]
    for row in rows:
        values = [float(v) for v in row[-len(ALL_SYSTEMS) :]]
        assert all(0 < v <= 1.0 for v in values)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.splitlines()[-1] == f"plot written to {png}"


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (["--preset", "google"], "meta"),
        (["--scales", "2048"], "1024, 16384, 131072"),
        (["--scales", "1024,1024"], "twice"),
        (["--systems", "recycle,torchft"], "replica-restart"),
        (["--rate", "2"], "poisson only"),
        (["--gpus", "1024"], "poisson only"),
        (["--png", "x.png"], "sweep, trace, poisson"),
        (["--plot", "x.jpg"], ".png"),
        (["--hours", "8000", "--seeds", "20"], "--hours"),
        (["--failures", "poisson"], "causes"),
        (["--recycle-costs", "guess"], "measured"),
        (["--repair-hours", "3"], "--failures single"),
    ],
)
def test_cli_ettr_bad_arguments(extra: list[str], mentions: str, tmp_path) -> None:
    code, out, err = _cli(["simulate", "ettr", "--model", "13B", "--tp", "8", "-P", "8", *extra])
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and mentions in err, err


def test_cli_ettr_option_refused_in_other_modes() -> None:
    code, out, err = _cli(
        ["simulate", "poisson", "--model", "13B", "--gpus", "64", "-P", "4", "--hours", "1", "--preset", "meta"]
    )
    assert code == 2 and "--preset is not allowed with poisson" in err and "ettr" in err, err


def test_cli_ettr_failure_model_and_recycle_costs() -> None:
    base = ["simulate", "ettr", "--model", "13B", "--tp", "8", "-P", "8", "--hours", "2", "--scales", "1024"]
    code, out, err = _cli([*base, "--preset", "meta"])
    assert code == 0, err
    assert "Llama 3 causes" in out and "detect 1 s + rebuild 3 s" in out
    code, out, err = _cli([*base, "--failures", "single", "--repair-hours", "3", "--recycle-costs", "paper"])
    assert code == 0, err
    assert "single-GPU failures, repair 3 h" in out and "detect 5 s + rebuild 10 s" in out
    code, out, err = _cli([*base, "--recycle-costs", "paper", "--recycle-rebuild", "7"])
    assert code == 0, err
    assert "detect 5 s + rebuild 7 s" in out


def test_recycle_spare_joins_in_the_recovery() -> None:
    job = small_job(D=4, P=4, m=8)
    nodes = [f"n{i}" for i in range(job.workers + 1)]
    events = [Event(1000.0, "remove", "n5")]
    separate = replay(Recycle(job), nodes, events, 4000.0)
    merged = replay(Recycle(job, RecycleParams(join_with_recovery=True)), nodes, events, 4000.0)
    rebuild = RecycleParams().rebuild_s
    assert separate.downtime - merged.downtime == pytest.approx(rebuild)
    assert merged.samples > separate.samples
