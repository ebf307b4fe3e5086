"""The recycle section is validated before anything starts, with errors that name the key."""

from __future__ import annotations

import pytest

import ds_recycle
from ds_recycle.config import MonitorConfig, RecycleConfig, RecycleConfigError, TimingEmulation, WandbMonitorConfig


def test_defaults_when_section_present():
    config = RecycleConfig.from_ds_config({"recycle": {}})
    assert config == RecycleConfig(enabled=True, decoupled_backprop=True, staggered_optimizer=True)


def test_absent_section_means_stock():
    assert RecycleConfig.from_ds_config({"train_batch_size": 8}).enabled is False


def test_full_section():
    config = RecycleConfig.from_ds_config(
        {
            "recycle": {
                "enabled": True,
                "decoupled_backprop": False,
                "staggered_optimizer": False,
                "emulate_timing": {"F": 10, "B": 12.5, "W": 0},
            }
        }
    )
    assert config.emulate_timing == TimingEmulation(10.0, 12.5, 0.0)
    assert config.emulate_timing.seconds("BW") == pytest.approx(0.0125)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"recycle": {"enabeld": True}}, "unknown key recycle.enabeld; allowed keys: enabled, decoupled_backprop"),
        ({"recycle": {"enabled": "yes"}}, "recycle.enabled must be true or false, got 'yes'"),
        ({"recycle": {"decoupled_backprop": 1}}, "recycle.decoupled_backprop must be true or false"),
        ({"recycle": {"staggered_optimizer": None}}, "recycle.staggered_optimizer must be true or false"),
        ({"recycle": {"prefetch_plans": "off"}}, "recycle.prefetch_plans must be true or false, got 'off'"),
        ({"recycle": []}, "'recycle' must be an object"),
        ({"recycle": {"emulate_timing": 5}}, "recycle.emulate_timing must be null or an object with keys F, B, W"),
        ({"recycle": {"emulate_timing": {"F": 1, "B": 1}}}, "recycle.emulate_timing.W is missing"),
        ({"recycle": {"emulate_timing": {"F": 1, "B": 1, "W": 1, "S": 1}}}, "unknown key recycle.emulate_timing.S"),
        ({"recycle": {"emulate_timing": {"F": -1, "B": 1, "W": 1}}}, "recycle.emulate_timing.F must be a number"),
        ({"recycle": {"emulate_timing": {"F": 1, "B": True, "W": 1}}}, "recycle.emulate_timing.B must be a number"),
        ({"recycle": {"emulate_timing": {"F": 1, "B": 1, "W": 1e9}}}, "in [0, 60000]"),
        ({"recycle": {}, "bf16": {"enabled": True}}, "'bf16.enabled' is not supported with recycle"),
        ({"recycle": {}, "fp16": {"enabled": True}}, "'fp16.enabled' is not supported with recycle"),
        ({"recycle": {}, "zero_optimization": {"stage": 1}}, "'zero_optimization.stage' = 1 is not supported"),
    ],
)
def test_invalid_sections_name_the_problem(section, message):
    with pytest.raises(RecycleConfigError) as err:
        RecycleConfig.from_ds_config(section)
    assert message in str(err.value)


def test_disabled_section_skips_deepspeed_compatibility_checks():
    assert not RecycleConfig.from_ds_config({"recycle": {"enabled": False}, "bf16": {"enabled": True}}).enabled


def test_initialize_rejects_bad_config_before_building_anything():
    with pytest.raises(RecycleConfigError, match="unknown key recycle.bogus"):
        ds_recycle.initialize(model=None, config={"train_batch_size": 4, "recycle": {"bogus": 1}})


def test_initialize_reads_config_files(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "recycle": {"enabled": "true"}}')
    with pytest.raises(RecycleConfigError, match="recycle.enabled must be true or false"):
        ds_recycle.initialize(model=None, config=str(path))


def test_initialize_needs_a_pipeline_module_when_enabled():
    import torch

    with pytest.raises(RecycleConfigError, match="recycle needs a deepspeed.pipe.PipelineModule, got Linear"):
        ds_recycle.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 4, "recycle": {}})


# ---- recycle.monitor ---------------------------------------------------------------------------


def test_monitor_defaults_to_none_and_reads_the_wandb_section():
    assert RecycleConfig.from_ds_config({"recycle": {}}).monitor == MonitorConfig(wandb=None)
    assert RecycleConfig.from_section({"monitor": None}).monitor.wandb is None
    assert RecycleConfig.from_section({"monitor": {"wandb": {"enabled": False, "project": "p"}}}).monitor.wandb is None
    monitor = RecycleConfig.from_section(
        {
            "monitor": {
                "wandb": {"project": "p", "group": "g", "mode": "offline", "tags": ["a"], "init_timeout": 5},
                "log_every": 10,
                "events_table": False,
            }
        }
    ).monitor
    assert monitor == MonitorConfig(
        wandb=WandbMonitorConfig(project="p", group="g", mode="offline", tags=("a",), init_timeout=5.0),
        log_every=10,
        events_table=False,
    )
    assert RecycleConfig.from_section({"monitor": {"wandb": {}}}).monitor.wandb == WandbMonitorConfig()


@pytest.mark.parametrize(
    ("monitor", "message"),
    [
        (3, "recycle.monitor must be null or an object with keys wandb, log_every, events_table"),
        ({"tensorboard": {}}, "unknown key recycle.monitor.tensorboard; allowed keys: wandb, log_every, events_table"),
        ({"\n": 1}, "unknown key recycle.monitor.'\\n'"),
        ({"log_every": 0}, "recycle.monitor.log_every must be an integer in [1, 1000000], got 0"),
        ({"log_every": True}, "recycle.monitor.log_every must be an integer"),
        ({"events_table": "yes"}, "recycle.monitor.events_table must be true or false, got 'yes'"),
        ({"wandb": "on"}, "recycle.monitor.wandb must be null or an object"),
        ({"wandb": {"projekt": "x"}}, "unknown key recycle.monitor.wandb.projekt; allowed keys: enabled, project,"),
        ({"wandb": {"enabled": 1}}, "recycle.monitor.wandb.enabled must be true or false"),
        ({"wandb": {"mode": "cloud"}}, "recycle.monitor.wandb.mode must be one of auto, online, offline, disabled"),
        ({"wandb": {"mode": ["offline"]}}, "recycle.monitor.wandb.mode must be one of"),
        ({"wandb": {"project": None}}, "recycle.monitor.wandb.project must be a non-empty string, got null"),
        ({"wandb": {"project": " "}}, "recycle.monitor.wandb.project must be null or a non-empty string"),
        ({"wandb": {"run_id": 7}}, "recycle.monitor.wandb.run_id must be null or a non-empty string"),
        ({"wandb": {"tags": "a"}}, "recycle.monitor.wandb.tags must be a list of strings"),
        ({"wandb": {"tags": [""]}}, "recycle.monitor.wandb.tags must be a list of strings of 1 to 64 characters"),
        ({"wandb": {"init_timeout": 0}}, "recycle.monitor.wandb.init_timeout must be a number of seconds in (0, 90]"),
        ({"wandb": {"init_timeout": float("nan")}}, "recycle.monitor.wandb.init_timeout must be a number"),
        ({"wandb": {"init_timeout": 91}}, "recycle.monitor.wandb.init_timeout must be a number"),
    ],
)
def test_invalid_monitor_sections_name_the_key_and_the_allowed_values(monitor, message):
    with pytest.raises(RecycleConfigError) as err:
        RecycleConfig.from_ds_config({"recycle": {"monitor": monitor}})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_initialize_rejects_a_bad_monitor_section_before_building_anything():
    with pytest.raises(RecycleConfigError, match="recycle.monitor.wandb.mode must be one of"):
        ds_recycle.initialize(
            model=None, config={"train_batch_size": 4, "recycle": {"monitor": {"wandb": {"mode": 1}}}}
        )
