"""The W&B monitor, offline: mode, run-id and DeepSpeed-coexistence rules, real event objects
logged to offline runs whose transaction logs are parsed back (tests/integrations/wandb_log.py),
and a real pp=2 x dp=2 job under ``ds-recycle launch`` whose W&B writer (rank 0) is SIGKILLed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import wandb_log

from ds_recycle.config import MonitorConfig, RecycleConfig
from ds_recycle.integrations.wandb import (
    EVENT_COLUMNS,
    FLUSH_INTERVAL_SECONDS,
    WandbMonitor,
    build_monitors,
    resolve_mode,
    resolve_run_id,
    share_run_through_environment,
    without_deepspeed_wandb,
)
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.runtime.shared.events import IterationStats, MembershipChange, PlanSummary

WANDB_ENV = ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_DIR")
WANDB_ENV += ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC", "DS_RECYCLE_TOKEN")
WANDB_ENV += (
    "WANDB_SERVICE",
    "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL",
)  # set by wandb in a process that started wandb-core: children would share it


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No W&B variable of the caller's environment; whatever a test (or the code under test) sets
    is removed afterwards. No API key: an empty netrc."""
    for key in WANDB_ENV:
        monkeypatch.setenv(key, "x")  # records the original value (or its absence) for teardown
        monkeypatch.delenv(key)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return monkeypatch


@pytest.fixture
def offline(tmp_path, clean_env):
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }.items():
        clean_env.setenv(key, value)
    yield tmp_path
    import wandb

    if wandb.run is not None:
        wandb.run.finish()


def monitor_config(section: dict) -> MonitorConfig:
    return RecycleConfig.from_section({"monitor": section}).monitor


def monitors(section: dict, **kwargs) -> list:
    return build_monitors(monitor_config(section), **kwargs)


# ---- configuration and environment -------------------------------------------------------------


def test_factory_builds_nothing_until_asked_and_opens_nothing_before_an_event(offline):
    assert monitors({}) == [] and monitors({"wandb": None}) == [] and monitors({"wandb": {"enabled": False}}) == []
    [monitor] = monitors({"wandb": {"project": "p", "tags": ["a"]}, "log_every": 5})
    assert isinstance(monitor, WandbMonitor)
    assert monitor.settings.project == "p" and monitor.settings.tags == ("a",) and monitor.config.log_every == 5
    assert monitor.run is None and not list(offline.glob("wandb/*run-*"))


def test_deepspeed_wandb_is_turned_off_only_when_ours_is_on(caplog):
    theirs = {"wandb": {"enabled": True, "project": "ds"}}
    ours = {"monitor": {"wandb": {"project": "p"}}}
    assert without_deepspeed_wandb({**theirs, "recycle": {"enabled": True}}) == {**theirs, "recycle": {"enabled": True}}
    off = {**theirs, "recycle": {"enabled": False, **ours}}  # ReCycle off: our monitor does not run
    assert without_deepspeed_wandb(off) == off
    both = {**theirs, "recycle": ours}
    with caplog.at_level("WARNING"):
        config = without_deepspeed_wandb(both)
    assert config["wandb"] == {"enabled": False, "project": "ds"}
    assert both["wandb"]["enabled"] is True  # the caller's dict is left alone
    assert "DeepSpeed's is turned off" in caplog.text


def test_auto_mode_is_offline_without_an_api_key(tmp_path, clean_env):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login u password p\n")
    assert resolve_mode("auto") == "offline"
    netrc.write_text("machine api.wandb.ai login user password k\n")
    assert resolve_mode("auto") == "online"
    netrc.write_text("")
    clean_env.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode("auto") == "online"
    clean_env.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"
    assert resolve_mode("offline") == "offline"


def test_one_run_id_per_launch_job(clean_env):
    assert resolve_run_id(None) is None
    clean_env.setenv("DS_RECYCLE_TOKEN", "secret-1")
    first = resolve_run_id(None)
    assert first == resolve_run_id(None) and first.startswith("recycle-") and "secret" not in first
    clean_env.setenv("DS_RECYCLE_TOKEN", "secret-2")
    assert resolve_run_id(None) != first
    clean_env.setenv("WANDB_RUN_ID", "mine")
    assert resolve_run_id(None) == "mine"
    assert resolve_run_id("configured") == "configured"


def test_the_run_is_shared_through_the_environment_without_overriding_it(clean_env):
    clean_env.setenv("DS_RECYCLE_TOKEN", "t")
    clean_env.setenv("WANDB_PROJECT", "users-own")
    share_run_through_environment(monitor_config({"wandb": {"project": "p", "group": "g"}}).wandb)
    assert os.environ["WANDB_RUN_ID"] == resolve_run_id(None) and os.environ["WANDB_RESUME"] == "allow"
    assert os.environ["WANDB_PROJECT"] == "users-own" and os.environ["WANDB_RUN_GROUP"] == "g"
    assert os.environ["WANDB_MODE"] == "offline"  # no API key: HF's own wandb.init must not raise
    assert "WANDB_ENTITY" not in os.environ and "WANDB_DIR" not in os.environ
    assert float(os.environ["WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"]) == FLUSH_INTERVAL_SECONDS


# ---- offline runs ------------------------------------------------------------------------------

FAULT_FREE = PlanSummary("ff", (), 100.0, 100.0, 100.0, (2, 2), 0)
PLAN = PlanSummary(
    plan_id="p7",
    failed=((1, 0),),
    predicted_iteration_time=130.0,
    fault_free_iteration_time=100.0,
    lower_bound=120.0,
    live_per_stage=(1, 2),
    rerouted_microbatches=4,
)


def iteration(i: int, epoch: int, plan_id: str = "ff", seconds: float = 0.5) -> IterationStats:
    return IterationStats(iteration=i, epoch=epoch, loss=4.0 - 0.1 * i, seconds=seconds, samples=16, plan_id=plan_id)


def failure(at: int) -> MembershipChange:
    return MembershipChange(
        epoch=1,
        iteration=at,
        failed=((1, 0),),
        detection_seconds=0.25,
        switch_seconds=0.5,
        recovery_seconds=0.9,
        rolled_back=True,
        plan=PLAN,
        time=time.time(),
    )


def rejoin(at: int) -> MembershipChange:
    return MembershipChange(
        epoch=2, iteration=at, joined=((1, 0),), detection_seconds=0.1, switch_seconds=0.7, plan=FAULT_FREE
    )


class Engine:
    """What a monitor reads from the engine: its membership history and its current plan."""

    def __init__(self) -> None:
        self.membership_changes: list[MembershipChange] = []
        self.plan = FAULT_FREE

    def plan_summary(self) -> PlanSummary:
        return self.plan

    def change(self, event: MembershipChange, *monitors: WandbMonitor) -> None:
        self.membership_changes.append(event)  # recorded on every rank, then the leader's monitors are called
        self.plan = event.plan or self.plan
        for monitor in monitors:
            monitor.on_membership_change(event)


def test_offline_run_holds_iterations_failure_and_rejoin(offline):
    ds_config = {
        "recycle": {"enabled": True, "monitor": {"wandb": {"project": "t", "run_id": "job-a", "dir": str(offline)}}}
    }
    engine = Engine()
    [monitor] = build_monitors(RecycleConfig.from_ds_config(ds_config).monitor, ds_config, engine)
    for i in (1, 2):
        monitor.on_iteration(iteration(i, 0))
    engine.change(failure(at=2), monitor)
    for i in (3, 4):
        monitor.on_iteration(iteration(i, 1, "p7", seconds=0.75))
    engine.change(rejoin(at=4), monitor)
    monitor.on_iteration(iteration(5, 2))
    monitor.close()
    assert not monitor.disabled

    [path] = wandb_log.run_files(offline, "job-a", finished=True)
    run = wandb_log.run_record(path)
    assert run.project == "t" and run.run_id == "job-a"
    assert wandb_log.config(path)["ds_config"] == ds_config
    rows = wandb_log.history(path)
    assert [r["train/global_step"] for r in rows] == [1, 2, 2, 3, 4, 4, 5]
    assert [r["recycle/membership_epoch"] for r in rows] == [0, 0, 1, 1, 1, 2, 2]
    assert [r["recycle/plan_id"] for r in rows] == ["ff", "ff", "p7", "p7", "p7", "ff", "ff"]
    assert [r["recycle/failed_workers"] for r in rows] == [0, 0, 1, 1, 1, 0, 0]
    assert rows[0]["recycle/ratio_to_fault_free"] == 1.0 and rows[0]["recycle/live_workers"] == 4
    failed = rows[2]
    assert failed["recycle/event/failed"] == 1 and failed["recycle/event/rolled_back"] == 1
    assert failed["recycle/event/detection_s"] == 0.25
    assert failed["recycle/event/switch_s"] == 0.5
    assert failed["recycle/event/recovery_s"] == 0.9
    assert failed["recycle/rerouted_microbatches"] == 4 and failed["recycle/predicted_iteration_time"] == 130.0
    assert failed["recycle/live_workers/stage_0"] == 1 and failed["recycle/live_workers/stage_1"] == 2
    assert failed["recycle/live_workers"] == 3 and failed["recycle/min_live_per_stage"] == 1
    assert failed["recycle/ratio_to_fault_free"] == pytest.approx(1.3)
    assert failed["recycle/ratio_to_lower_bound"] == pytest.approx(130 / 120)
    for row in rows[3:5]:  # iterations on the degraded plan carry it and their measured cost
        assert row["recycle/iteration_time_s"] == 0.75 and row["recycle/samples_per_s"] == pytest.approx(16 / 0.75)
        assert row["recycle/measured_ratio_to_fault_free"] == pytest.approx(1.5)
        assert row["recycle/loss"] == pytest.approx(4.0 - 0.1 * row["train/global_step"])
    assert rows[5]["recycle/event/joined"] == 1 and "recycle/event/recovery_s" not in rows[5]
    assert rows[6]["recycle/measured_ratio_to_fault_free"] == 1.0

    table = json.loads((path.parent / "files" / rows[5]["recycle/events/path"]).read_text())
    assert table["columns"] == EVENT_COLUMNS
    assert [r[:5] for r in table["data"]] == [[2, 1, "failed", 1, 0], [4, 2, "joined", 1, 0]]
    assert table["data"][0][5:10] == [0.25, 0.5, 0.9, True, "p7"]
    summary = wandb_log.summary(path)
    assert summary["recycle/total_failures"] == 1 and summary["recycle/total_joins"] == 1
    assert summary["recycle/max_recovery_s"] == 0.9
    assert "exit" in wandb_log.kinds(path)


def test_log_every_thins_iterations_not_membership_changes(offline):
    [monitor] = monitors({"wandb": {"run_id": "job-every", "dir": str(offline)}, "log_every": 2, "events_table": False})
    for i in range(1, 6):
        monitor.on_iteration(iteration(i, 0))
    monitor.on_membership_change(failure(at=5))
    monitor.close()
    [path] = wandb_log.run_files(offline, "job-every", finished=True)
    rows = wandb_log.history(path)
    assert [r["train/global_step"] for r in rows] == [2, 4, 5]
    assert "recycle/events" not in rows[2] and rows[2]["recycle/event/failed"] == 1


def test_a_new_writer_resumes_the_same_run_id_with_the_whole_history(offline):
    engine = Engine()
    first, second = (
        monitors({"wandb": {"project": "t", "run_id": "job-b", "dir": str(offline)}}, engine=engine)[0]
        for _ in range(2)
    )
    first.on_iteration(iteration(1, 0))
    engine.change(failure(at=1), first)
    first.on_iteration(iteration(2, 1, "p7"))
    first.close()  # the old writer is gone; the engine calls the next lowest rank's monitors
    time.sleep(1.1)  # offline run directories are named by the second they start in
    engine.change(rejoin(at=2), second)
    second.on_iteration(iteration(3, 2))
    second.close()
    paths = wandb_log.run_files(offline, "job-b", finished=True)
    assert len(paths) == 2  # offline, each writer has its own directory of the one run id
    assert [wandb_log.run_record(p).run_id for p in paths] == ["job-b", "job-b"]
    steps = [r["train/global_step"] for p in paths for r in wandb_log.history(p)]
    assert steps == [1, 1, 2, 2, 3]
    rows = wandb_log.history(paths[1])
    table = json.loads((paths[1].parent / "files" / rows[0]["recycle/events/path"]).read_text())
    assert [r[2] for r in table["data"]] == ["failed", "joined"]  # the first writer's event too
    summary = wandb_log.summary(paths[1])
    assert summary["recycle/total_failures"] == 1 and summary["recycle/total_joins"] == 1


def test_an_open_run_is_shared_not_reopened(offline):
    import wandb

    run = wandb.init(project="hf", id="hf-run", mode="offline", dir=offline)  # as HF's WandbCallback would
    [monitor] = monitors({"wandb": {"project": "ignored"}})
    monitor.on_iteration(iteration(1, 0))
    monitor.close()
    assert monitor.run is None and wandb.run is run  # not finished: its owner finishes it
    run.log({"train/loss": 1.0, "train/global_step": 1})
    run.finish()
    assert len(list(offline.glob("wandb/offline-run-*"))) == 1
    [path] = wandb_log.run_files(offline, "hf-run", finished=True)
    assert wandb_log.run_record(path).project == "hf"
    rows = wandb_log.history(path)
    assert [sorted(k for k in r if k in ("recycle/loss", "train/loss")) for r in rows] == [
        ["recycle/loss"],
        ["train/loss"],
    ]


def test_no_api_key_and_no_wandb_mode_logs_offline(offline, clean_env):
    clean_env.delenv("WANDB_MODE")
    [monitor] = monitors({"wandb": {"run_id": "job-nokey", "dir": str(offline)}})
    monitor.on_iteration(iteration(1, 0))
    monitor.close()
    assert not monitor.disabled
    [path] = wandb_log.run_files(offline, "job-nokey", finished=True)
    assert [r["train/global_step"] for r in wandb_log.history(path)] == [1]


def test_a_wandb_error_disables_the_monitor_without_raising(offline, monkeypatch, caplog):
    import wandb

    def broken(*args, **kwargs):
        raise wandb.errors.UsageError("No API key configured")

    monkeypatch.setattr(wandb, "init", broken)
    [monitor] = monitors({"wandb": {"project": "t", "mode": "offline"}})
    with caplog.at_level("WARNING"):
        monitor.on_iteration(iteration(1, 0))
        monitor.on_membership_change(failure(at=1))
        monitor.close()
    assert monitor.disabled
    assert caplog.text.count("W&B monitor disabled after an error: UsageError") == 1


def test_online_start_failure_falls_back_to_offline(offline, monkeypatch):
    import wandb

    real_init = wandb.init
    modes = []

    def init(*args, mode=None, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("unreachable")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    [monitor] = monitors({"wandb": {"project": "t", "mode": "online", "run_id": "job-c", "dir": str(offline)}})
    monitor.on_iteration(iteration(1, 0))
    monitor.close()
    assert modes == ["online", "offline"] and not monitor.disabled
    assert len(wandb_log.run_files(offline, "job-c", finished=True)) == 1


# ---- a real job: the writer is killed ----------------------------------------------------------

WORKER = Path(__file__).with_name("monitor_worker.py")
STEPS, KILL_AFTER = 6, 3


@pytest.mark.multiprocess
def test_killing_the_writer_moves_the_run_to_the_next_lowest_rank(tmp_path, clean_env, caplog):
    from ds_recycle.runtime.node.launcher import launch

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "wandb": {"enabled": True, "project": "deepspeed-own"},  # turned off: one writer, ours
        # No re-plans from measured costs (tests/engine/test_profile.py): each epoch keeps its plan.
        "recycle": {
            "enabled": True,
            "profile": False,
            "monitor": {"wandb": {"project": "kill-test", "run_id": "kill-job"}},
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    argv = [str(WORKER), "--config", str(tmp_path / "ds.json"), "--out", str(tmp_path)]
    argv += ["--steps", str(STEPS), "--kill_rank", "0", "--kill_after", str(KILL_AFTER), "--kill_delay", "2"]
    env = {"WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "NETRC": os.environ["NETRC"]}
    env |= {"WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}
    results = launch(
        argv, world_size=4, timeout=150, log_dir=tmp_path / "logs", env=env, preload=PRELOAD_MODULES
    )  # no WANDB_MODE, no key
    by_rank = {r.rank: r for r in results}
    assert by_rank[0].returncode == -9, by_rank[0].log[-3000:]
    for rank in (1, 2, 3):
        assert by_rank[rank].ok, f"rank {rank} exited {by_rank[rank].returncode}:\n{by_rank[rank].log[-4000:]}"
        record = json.loads((tmp_path / f"{rank}.json").read_text())
        assert record["global_steps"] == STEPS and record["monitors"] == ["WandbMonitor"]
    assert "DeepSpeed's is turned off" in by_rank[1].log

    paths = sorted(tmp_path.glob("wandb/*-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    assert [p.parent.name.split("-")[0] for p in paths] == ["offline", "offline"]  # auto mode, no key
    assert [wandb_log.run_record(p).run_id for p in paths] == ["kill-job", "kill-job"]  # nothing from DeepSpeed
    assert {wandb_log.run_record(p).project for p in paths} == {"kill-test"}
    first, second = (wandb_log.history(p) for p in paths)
    # rank 0 wrote every iteration up to its death: its wandb-core, killed with it, had flushed them
    # (W&B flushes every FLUSH_INTERVAL_SECONDS; the rank dies 2 s after its last row)
    assert [r["train/global_step"] for r in first] == list(range(1, KILL_AFTER + 1))
    assert all(r["recycle/failed_workers"] == 0 and r["recycle/live_workers"] == 4 for r in first)

    event, *after = second  # rank 1 took over: the membership change first, then every later iteration
    assert event["recycle/membership_epoch"] == 1 and event["recycle/event/failed"] == 1
    assert event["train/global_step"] in (KILL_AFTER - 1, KILL_AFTER)  # the in-flight iteration may roll back
    # detection counts from the launcher's waitpid, which a survivor's failed receive may precede: >= 0
    assert 0 <= event["recycle/event/detection_s"] < 60
    assert 0 < event["recycle/event/switch_s"] < 60 and 0 < event["recycle/event/recovery_s"] < 60
    assert event["recycle/event/recovery_s"] >= event["recycle/event/detection_s"]
    assert event["recycle/live_workers/stage_0"] == 1 and event["recycle/live_workers/stage_1"] == 2
    assert event["recycle/failed_workers"] == 1 and event["recycle/rerouted_microbatches"] > 0
    assert event["recycle/ratio_to_fault_free"] > 1 and event["recycle/ratio_to_lower_bound"] >= 1
    table = json.loads((paths[1].parent / "files" / event["recycle/events/path"]).read_text())
    assert [r[2:5] for r in table["data"]] == [["failed", 0, 0]]
    assert [r["train/global_step"] for r in after] == list(range(event["train/global_step"] + 1, STEPS + 1))
    for row in after:
        assert row["recycle/plan_id"] == event["recycle/plan_id"] and row["recycle/membership_epoch"] == 1
        assert row["recycle/iteration_time_s"] > 0 and row["recycle/samples_per_s"] > 0
    summary = wandb_log.summary(paths[1])
    assert summary["recycle/total_failures"] == 1 and summary["recycle/max_recovery_s"] > 0
    assert "exit" in wandb_log.kinds(paths[1])  # finished at exit (atexit) by its writer
    changes = json.loads((tmp_path / "1.json").read_text())["changes"]
    assert len(changes) == 1 and changes[0]["recovery_seconds"] == pytest.approx(event["recycle/event/recovery_s"])
