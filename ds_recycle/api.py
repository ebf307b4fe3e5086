"""The user's entry points: ``initialize`` (``deepspeed.initialize`` with a RecyclePipelineEngine
for pipeline modules) and ``init_distributed``."""

from __future__ import annotations

import os

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from ds_recycle import monitoring
from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.data import DatasetMicroBatches
from ds_recycle.engine import RecyclePipelineEngine
from ds_recycle.log import logger
from ds_recycle.runtime.rank import exit_guard
from ds_recycle.runtime.rank.distributed import init_distributed, membership_agent
from ds_recycle.runtime.rank.recovery import RankRuntime
from ds_recycle.runtime.shared import keys
from ds_recycle.runtime.shared.events import Monitor

__all__ = ["init_distributed", "initialize"]


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
    monitors: list[Monitor] | None = None,
):
    """Same signature and return value as ``deepspeed.initialize``: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. The ``recycle`` section is validated first, before any
    process group or engine is created.

    ``training_data`` is a map-style dataset (as for DeepSpeed: micro-batch (h, k) of iteration i is
    what DeepSpeed's loader would give pipeline h) or, with ReCycle, a provider: a callable
    ``(iteration, home, mb) -> batch`` or an object with such a ``get`` method. Either lets any
    worker load any pipeline's micro-batches, which a first- or last-stage failure needs.

    Under ``ds-recycle launch``, a respawned process returns from here already caught up: it was
    admitted at an iteration boundary and holds a live replica's state, ``engine.global_steps``
    included.

    ``monitors``: objects with ``on_membership_change``, ``on_iteration`` and ``close``
    (:class:`ds_recycle.runtime.shared.events.Monitor`), called on the lowest live rank, besides those that
    ``recycle.monitor`` names."""
    config = _resolve_config(args, config if config is not None else config_params)
    recycle = RecycleConfig.from_ds_config(config)
    config = monitoring.prepare_ds_config(config, recycle)  # e.g. recycle.monitor.wandb replaces DeepSpeed's
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
    provider = None
    if recycle.enabled and training_data is not None and not _is_map_style(training_data):
        provider = getattr(training_data, "get", training_data)
        if not callable(provider):
            raise TypeError(
                f"training_data must be a map-style torch Dataset or a provider (iteration, home, mb) -> batch, "
                f"got {type(training_data).__name__}"
            )
        training_data = None
    agent = membership_agent()
    if agent is None and os.environ.get(keys.ENV_STORE):
        _refuse_foreign_init()
    if agent is not None and not recycle.enabled:
        raise RecycleConfigError(
            "this process was started by ds-recycle launch, which needs recycle.enabled: true in the DeepSpeed "
            "config (or use the deepspeed launcher for a run without ReCycle)"
        )

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
        micro_batch_source=provider,
        runtime=RankRuntime(agent, recycle) if agent is not None else None,
    )
    engine._configure_python_gc()
    monitoring.attach(engine, recycle, config, monitors or ())  # called on the lowest live rank only
    if recycle.enabled and training_data is not None:
        engine.micro_batch_source = DatasetMicroBatches(
            training_data,
            pipelines=model._topo.get_dim("data"),
            micro_batches=engine.gradient_accumulation_steps(),
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
            collate_fn=collate_fn,
            drop_last=engine.dataloader_drop_last(),
        )
    if recycle.enabled and not (agent is not None and agent.is_joiner):
        engine.checkpointer.resume()  # recycle.checkpoint: continue from its latest, if any
    if engine.runtime is not None:
        if agent.is_joiner:
            engine.runtime.join()
        else:
            engine.runtime.start()
            engine.feed.warn_if_per_pipeline()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _refuse_foreign_init() -> None:
    """Under ds-recycle launch torch.distributed was started by someone else (deepspeed.init_distributed):
    this rank has no membership agent, so a SIGTERM would kill it and a respawn could never join.
    Stop the job at its start, before any iteration, with the one change to make."""
    logger.error(
        "ReCycle: this process was started by ds-recycle launch, but torch.distributed was started without "
        "ds_recycle.init_distributed(): call ds_recycle.init_distributed() instead of "
        "deepspeed.init_distributed() (before building the PipelineModule); it joins the job's coordinator, "
        "so that a rank can leave, fail and re-join"
    )
    raise exit_guard.exit(keys.STOP_EXIT_CODE)


def _is_map_style(data) -> bool:
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


def _resolve_config(args, config):
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("give the DeepSpeed config either as --deepspeed_config or as config=, not both")
        config = from_args
    if config is None:
        raise ValueError("a DeepSpeed config is required: pass config= (dict or path) or --deepspeed_config")
    if isinstance(config, dict):
        return load_ds_config(config)
    is_file = isinstance(config, (str, os.PathLike)) and os.path.isfile(config)
    try:
        return load_ds_config(str(config) if is_file else config)
    except OSError as error:
        raise RecycleConfigError(f"the DeepSpeed config file {config} cannot be read: {error}") from error
    except ValueError as error:  # hjson's decode errors (NaN and Infinity are not JSON either)
        if is_file:
            raise RecycleConfigError(f"the DeepSpeed config file {config} is not valid JSON: {error}") from error
        raise RecycleConfigError(
            f"the DeepSpeed config must be a dict, the path of an existing JSON file or base64-encoded JSON; "
            f"got {config!r}"
        ) from error
