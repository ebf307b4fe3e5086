"""``RecycleTrainingArguments`` and the ds_config: ``--deepspeed`` parses as in HF, ``"auto"`` is
filled from the arguments with D = world / stages, and a contradiction names both keys."""

from __future__ import annotations

import json

import pytest

from ds_recycle.integrations.hf import DeepSpeedArgumentsError, RecycleTrainingArguments, fill_ds_config

BASE = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "pipeline": {"stages": 2},
    "recycle": {"enabled": True},
}


def parse(tmp_path, config: dict, *argv: str) -> RecycleTrainingArguments:
    from transformers import HfArgumentParser

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    parser = HfArgumentParser(RecycleTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--deepspeed", str(path), "--output_dir", str(tmp_path / "out"), "--report_to", "none", *argv]
    )
    return args


def test_deepspeed_flag_is_kept_from_accelerate(tmp_path):
    args = parse(tmp_path, BASE, "--per_device_train_batch_size", "3")
    assert args.deepspeed is None and args.deepspeed_plugin is None
    assert args.recycle_ds_config == BASE
    assert args.pipeline_stages() == 2
    assert args.remove_unused_columns is False and args.dataloader_drop_last is True


def test_auto_values_are_filled_with_pipelines_not_world(tmp_path):
    args = parse(tmp_path, BASE, "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "5")
    filled = args.filled_ds_config(data_parallel_size=4, max_steps=10, warmup_steps=0)
    assert filled["train_micro_batch_size_per_gpu"] == 3
    assert filled["gradient_accumulation_steps"] == 5
    assert filled["train_batch_size"] == 3 * 5 * 4
    assert filled["gradient_clipping"] == 1.0
    assert filled["dataloader_drop_last"] is True
    assert filled["recycle"] == {"enabled": True}


def test_optimizer_and_scheduler_autos(tmp_path):
    config = {
        **BASE,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
    }
    args = parse(tmp_path, config, "--learning_rate", "0.003", "--weight_decay", "0.1")
    filled = args.filled_ds_config(data_parallel_size=2, max_steps=40, warmup_steps=4)
    assert filled["optimizer"]["params"] == {
        "lr": 0.003,
        "weight_decay": 0.1,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
    }
    assert filled["scheduler"]["params"] == {"warmup_num_steps": 4, "total_num_steps": 40}


def test_a_contradiction_names_both_keys(tmp_path):
    config = {**BASE, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5}
    args = parse(tmp_path, config, "--per_device_train_batch_size", "2")
    with pytest.raises(DeepSpeedArgumentsError) as error:
        args.filled_ds_config(data_parallel_size=2, max_steps=10, warmup_steps=0)
    message = str(error.value)
    assert "ds_config train_micro_batch_size_per_gpu=8 but TrainingArguments per_device_train_batch_size=2" in message
    assert "ds_config gradient_clipping=0.5 but TrainingArguments max_grad_norm=1.0" in message


def test_train_batch_size_uses_the_number_of_pipelines(tmp_path):
    config = {**BASE, "train_batch_size": 16}
    args = parse(tmp_path, config, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4")
    assert fill_ds_config(config, args, 2, 10, 0)["train_batch_size"] == 16
    with pytest.raises(DeepSpeedArgumentsError, match=r"train_batch_size=16 but .* \(2 x 4 x 4\)=32"):
        fill_ds_config(config, args, 4, 10, 0)


def test_stages_must_be_known_and_agree(tmp_path):
    no_stages = {k: v for k, v in BASE.items() if k != "pipeline"}
    with pytest.raises(DeepSpeedArgumentsError, match="pipeline.stages"):
        parse(tmp_path, no_stages).pipeline_stages()
    assert parse(tmp_path, no_stages, "--pipeline_parallel_size", "4").pipeline_stages() == 4
    with pytest.raises(DeepSpeedArgumentsError, match="pipeline.stages=2 but .* pipeline_parallel_size=4"):
        parse(tmp_path, BASE, "--pipeline_parallel_size", "4").pipeline_stages()


def test_fp16_is_refused(tmp_path):
    args = parse(tmp_path, BASE)
    args.fp16 = True
    with pytest.raises(DeepSpeedArgumentsError, match="fp32"):
        args.filled_ds_config(2, 10, 0)
