"""``initialize``: ``deepspeed.initialize`` with a RecyclePipelineEngine for pipeline modules."""

from __future__ import annotations

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine import RecyclePipelineEngine


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    config_params=None,
):
    """Same signature and return value as ``deepspeed.initialize``: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. The ``recycle`` section is validated first, before any
    process group or engine is created."""
    config = _resolve_config(args, config if config is not None else config_params)
    recycle = RecycleConfig.from_ds_config(config)
    if not isinstance(model, PipelineModule):
        if recycle.enabled:
            raise RecycleConfigError(
                f"recycle needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}; "
                "remove the 'recycle' section or set recycle.enabled to false for other models"
            )
        return deepspeed.initialize(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            distributed_port=distributed_port,
            mpu=mpu,
            dist_init_required=dist_init_required,
            collate_fn=collate_fn,
            config=config,
        )
    if mpu is not None:
        raise ValueError("mpu must be None with pipeline parallelism: the PipelineModule provides its grid")

    dist.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = RecyclePipelineEngine(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        config_class=config_class,
        recycle_config=recycle,
    )
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resolve_config(args, config):
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("give the DeepSpeed config either as --deepspeed_config or as config=, not both")
        config = from_args
    if config is None:
        raise ValueError("a DeepSpeed config is required: pass config= (dict or path) or --deepspeed_config")
    return load_ds_config(config)
