"""Traces, time conservation, the three experiments and the CLI's JSON."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from helpers import small_job

from ds_recycle.cli import main
from ds_recycle.sim.experiments import SYSTEMS, placement_workers, poisson, poisson_events, sweep, trace_replay
from ds_recycle.sim.job import Job
from ds_recycle.sim.presets import get_model
from ds_recycle.sim.timeline import Event, Phase, replay
from ds_recycle.sim.traces import TraceError, parse_trace, read_trace, shipped_traces

TRACES = shipped_traces()


def test_every_shipped_trace_is_read() -> None:
    assert len(TRACES) >= 10, "the shipped traces (ds_recycle/sim/data/traces) are missing"
    for path in TRACES:
        trace = read_trace(path)
        assert trace.duration > 0 and 1 <= trace.peak <= 40 and trace.removals > 0
        assert all(0 < e.time <= trace.duration for e in trace.events)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no events"),
        ("0,add\n", "fields"),
        ("x,add,n1\n", "not a number"),
        ("nan,add,n1\n", "not a number"),
        ("-5,add,n1\n", "not a number"),
        ("1e3,add,n1\n", "not a number"),
        ("10,add,n1\n5,add,n2\n", "before"),
        ("0,join,n1\n", "add or remove"),
        ("0,add,n1\n1,add,n1\n", "twice"),
        ("0,remove,n1\n", "not present"),
        ("0,add,\n", "node name"),
        ("0,add,n1\n0,add,n2\n", "one instant"),
        ("0,add,n1,extra\n", "fields"),
    ],
)
def test_bad_traces_are_refused(text: str, why: str) -> None:
    with pytest.raises(TraceError, match=why):
        parse_trace(text)


def _check_conservation(run, horizon: float) -> None:
    assert run.segments[0][0] == 0 and run.segments[-1][1] == pytest.approx(horizon)
    for (_a, end, _r), (start, _b, _s) in zip(run.segments, run.segments[1:], strict=False):
        assert start == pytest.approx(end)
    assert sum((e - s) * r for s, e, r in run.segments) == pytest.approx(run.samples, rel=1e-9)
    assert sum(e - s for s, e, r in run.segments if r == 0) == pytest.approx(run.downtime, abs=1e-6)


@pytest.mark.parametrize("name", ["bamboo-g4dn", "oobleck-synthetic-10m"])
def test_trace_replay_conserves_time(name: str) -> None:
    trace = read_trace(next(p for p in TRACES if p.stem == name))
    job = Job(get_model("350M"), trace.peak // 8, 8, 4, failures_per_hour=trace.removals / (trace.duration / 3600))
    study = trace_replay(job, trace)
    for run in study.runs.values():
        _check_conservation(run, trace.duration)
        assert 0 <= run.samples_per_s


def test_pauses_pending_at_a_new_event_are_kept() -> None:
    class Toy:
        name, notes = "toy", []

        def start(self, nodes):
            return [Phase(math.inf, 1.0)]

        def change(self, now, removed, added):
            return [Phase(10.0, 0.0, "pause"), Phase(math.inf, 2.0)]

    run = replay(Toy(), ["a"], [Event(5.0, "remove", "a"), Event(8.0, "add", "b")], 30.0)
    _check_conservation(run, 30.0)
    assert run.downtime == pytest.approx(20.0)  # 5..15 then 15..25 (the second pause follows the first)
    assert run.samples == pytest.approx(5.0 + 2.0 * 5.0)


def test_placements() -> None:
    assert placement_workers(4, 4, 3, "spread") == [(0, 0), (1, 1), (2, 2)]
    assert placement_workers(4, 4, 3, "stage") == [(0, 3), (1, 3), (2, 3)]
    assert placement_workers(4, 4, 3, "pipeline") == [(0, 0), (0, 1), (0, 2)]


def test_sweep_rows_and_ratios() -> None:
    study = sweep(small_job(4, 4, 8), "spread")
    assert [row.failures for row in study.rows] == [0, 1, 2, 3]
    first = study.rows[0]
    assert first.runs["recycle"].downtime == 0 and first.steady["recycle"] == pytest.approx(
        first.runs["recycle"].samples_per_s
    )
    assert first.recycle["rerouting_only_samples_per_s"] == pytest.approx(first.steady["checkpoint"])
    assert first.steady["oobleck"] == pytest.approx(first.steady["checkpoint"])
    ratios = study.ratios()
    assert ratios["recycle/oobleck"]["max"] >= ratios["recycle/oobleck"]["overall"] * (1 - 1e-9)


def test_poisson_events_follow_the_rate() -> None:
    initial, events = poisson_events(100, 5, rate_per_worker_hour=0.01, hours=200, repair_hours=1, seed=0)
    assert len(initial) == 105
    removals = [e for e in events if e.kind == "remove"]
    assert 160 <= len(removals) <= 260  # mean 105 x 0.01 x 200 = 210
    adds = [e for e in events if e.kind == "add"]
    assert len(removals) - 1 <= len(adds) + 1 and all(e.time <= 200 * 3600 for e in events)


def test_poisson_study_runs_and_orders_checkpoint_last() -> None:
    job = Job(get_model("13B", tp=8), 4, 4, 8, failures_per_hour=None)
    study = poisson(job, rate_multiple=50, hours=48, repair_hours=4)
    for run in study.runs.values():
        _check_conservation(run, 48 * 3600)
    assert study.series[0]["failures"] > 3
    assert study.samples_per_s("recycle") > study.samples_per_s("checkpoint")


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_json_schema(tmp_path) -> None:
    path = tmp_path / "s.json"
    code, out, err = _cli(
        ["simulate", "sweep", "--model", "350M", "-D", "2", "-P", "2", "-m", "4", "--json", str(path)]
    )
    assert code == 0, err
    assert out.strip().splitlines()[-2].startswith("max ratio recycle/oobleck ")
    data = json.loads(path.read_text())
    assert set(data["systems"]) == set(SYSTEMS)
    for entry in data["systems"].values():
        assert entry["samples_per_s"] >= 0 and "downtime_s" in entry
    assert [row["failures"] for row in data["rows"]] == [0, 1]
    for row in data["rows"]:
        assert set(row["systems"]) == set(SYSTEMS)
        assert all("samples_per_s" in v and "steady_samples_per_s" in v for v in row["systems"].values())
    assert {"recycle/oobleck", "recycle/bamboo"} <= set(data["ratios"])


def test_cli_trace_and_poisson_with_png(tmp_path) -> None:
    trace = next(p for p in TRACES if p.stem == "oobleck-synthetic-1h")
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    argv = ["simulate", "trace", "--trace", str(trace), "--model", "350M", "-P", "8", "-m", "4"]
    code, out, err = _cli([*argv, "--png", str(png), "--json", str(js)])
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(js.read_text())["systems"]["recycle"]["segments"]
    assert out.splitlines()[-3].startswith("max ratio recycle/oobleck")
    code, out, err = _cli(["simulate", "poisson", "--model", "13B", "--gpus", "64", "-P", "4", "--hours", "24"])
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        (["sweep", "--model", "GPT-5", "-D", "2", "-P", "2", "-m", "4"], "--model"),
        (["sweep", "--model", "175B", "--tp", "1", "-D", "2", "-P", "4", "-m", "4"], "--stages"),
        (["sweep", "--model", "1.3B", "-P", "2", "-m", "4"], "--pipelines"),
        (["sweep", "--model", "1.3B", "-D", "2", "-P", "2", "-m", "4", "--gpus", "8"], "--gpus"),
        (["trace", "--model", "1.3B", "-P", "2", "-m", "4", "--trace", "/nonexistent.csv"], "--trace"),
        (["poisson", "--model", "1.3B", "-P", "2", "--gpus", "1", "--hours", "1"], "--gpus"),
        (["poisson", "--model", "1.3B", "-P", "2", "--gpus", "65536", "--hours", "8000", "--rate", "100"], "--rate"),
        (["sweep", "--model", "1.3B", "-D", "2", "-P", "2", "-m", "4", "--systems", "recycle,foo"], "--systems"),
        (["sweep", "--model", "1.3B", "-D", "2", "-P", "2", "-m", "nan"], "--microbatches"),
    ],
)
def test_cli_errors_exit_2_with_one_line(argv: list[str], mentions: str, tmp_path) -> None:
    code, out, err = _cli(["simulate", *argv])
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and mentions in err, err


@pytest.mark.parametrize("content", ["0,add,n1\nnan,remove,n1\n", "a,b\n", "\xff"])
def test_cli_bad_trace_file(content: str, tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(content.encode("latin-1"))
    code, out, err = _cli(["simulate", "trace", "--model", "1.3B", "-P", "2", "-m", "4", "--trace", str(path)])
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "--trace" in err, err


def test_cli_trace_by_shipped_name() -> None:
    by_name = _cli(["simulate", "trace", "--trace", "oobleck-synthetic-6h", "--model", "350M", "-P", "8", "-m", "4"])
    path = str(next(p for p in TRACES if p.stem == "oobleck-synthetic-6h"))
    by_path = _cli(["simulate", "trace", "--trace", path, "--model", "350M", "-P", "8", "-m", "4"])
    assert by_name[0] == 0, by_name[2]
    assert by_name == by_path


def test_cli_unknown_trace_name_lists_the_shipped_names() -> None:
    code, out, err = _cli(["simulate", "trace", "--trace", "spot-2031", "--model", "1.3B", "-P", "2", "-m", "4"])
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "--trace spot-2031" in err and all(path.stem in err for path in TRACES), err
