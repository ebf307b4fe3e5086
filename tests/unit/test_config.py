"""The recycle section is validated before anything starts, with errors that name the key."""

from __future__ import annotations

import pytest

import ds_recycle
from ds_recycle.config import RecycleConfig, RecycleConfigError, TimingEmulation


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
