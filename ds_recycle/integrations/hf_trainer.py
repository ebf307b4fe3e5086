"""``RecycleTrainer``: ``transformers.Trainer`` driving a ReCycle pipeline engine.

What changes in a HF script: the import, ``Trainer`` -> ``RecycleTrainer``, ``TrainingArguments`` ->
``RecycleTrainingArguments``, and ``--deepspeed ds_config.json`` (with a ``pipeline.stages`` and
a ``recycle`` section). The model may be a ``PreTrainedModel`` (its weights are copied into
pipeline layers), a ``PretrainedConfig`` (fresh HF init) or a ready ``PipelineModule``.

How it runs:

- ``RecycleTrainingArguments`` takes ``--deepspeed`` as HF users know it but keeps it away from
  accelerate (which cannot run pipelines); ``"auto"`` values are filled from the arguments, and a
  value that contradicts an argument is an error naming both.
- The engine comes from ``ds_recycle.initialize`` with the map-style ``train_dataset`` as
  ``training_data``: micro-batch (h, k) of iteration i is what DeepSpeed's pipeline loader gives
  pipeline h, so any worker can load any pipeline's micro-batches and a resumed run continues at
  the sample where it stopped. The Trainer's own data loader only paces the loop (one tick per
  micro-batch); each optimizer step is one ``engine.train_batch``.
- Checkpoints keep HF's layout: ``checkpoint-N/`` holds the DeepSpeed checkpoint (``latest``,
  ``global_stepN/``), HF safetensors shards (one per stage) with ``config.json``, the RNG states
  and ``trainer_state.json``. ``save_model`` writes the same safetensors, loadable by
  ``from_pretrained``.
- The process that logs and saves is the engine's lowest live rank, not a fixed rank 0.
- ``evaluate()``, ``predict()`` and ``eval_strategy`` ("steps", "epoch") run ``engine.eval_batch``
  over the live workers (a forward-only plan: every micro-batch once, whatever the failure set).
  The eval set is cut into micro-batches of the training micro-batch size (the pipeline's
  activations keep one shape), in order: eval step t, pipeline h, micro-batch k holds samples
  from ``((t D + h) m_t + k) x mbs`` on, where a last step shorter than m micro-batches per
  pipeline runs with fewer (``num_micro_batches``). The metric is the loss, ``<prefix>_loss``:
  the mean of the micro-batches' mean losses; predictions are not gathered (``compute_metrics``
  is refused).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.runtime.pipe.module import PipelineModule
from torch.utils.data import DataLoader, Dataset
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ExportableState, ProgressCallback, TrainerState
from transformers.trainer_utils import EvalLoopOutput, SaveStrategy
from transformers.utils import logging as hf_logging

from ds_recycle.config import RecycleConfig, RecycleConfigError, WandbMonitorConfig
from ds_recycle.integrations.hf_model import causal_lm_pipeline, load_hf_state_dict, pipeline_batch, to_hf_state_dict
from ds_recycle.integrations.wandb import share_run_through_environment
from ds_recycle.runtime.rank.waiting import Waiter

AUTO = "auto"
_JOINED = "<re-joined a running job>"
"""Stands for a checkpoint in Trainer's loop: a joiner skips the steps trained before it joined."""
logger = hf_logging.get_logger(__name__)
SAFE_INDEX = "model.safetensors.index.json"


class DeepSpeedArgumentsError(ValueError):
    """The ds_config and the TrainingArguments disagree, or the ds_config cannot run as a pipeline."""


# ---- arguments ---------------------------------------------------------------------------------


@dataclass
class RecycleTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose ``deepspeed`` config drives a ReCycle pipeline engine.

    Defaults differ from HF's where a pipeline needs it: ``remove_unused_columns=False`` (the
    model's forward takes one packed input) and ``dataloader_drop_last=True`` (every micro-batch
    has the same shape)."""

    pipeline_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Pipeline stages P (world = P x D). Default: the ds_config's pipeline.stages."},
    )
    pipeline_partition_method: str = field(
        default="type:DecoderLayerPipe",
        metadata={"help": "DeepSpeed partition_method for models built by causal_lm_pipeline."},
    )
    remove_unused_columns: bool = field(default=False)
    dataloader_drop_last: bool = field(default=True)

    def __post_init__(self) -> None:
        self.recycle_ds_config_source = self.deepspeed
        if self.deepspeed is None:
            raise DeepSpeedArgumentsError("RecycleTrainingArguments needs --deepspeed ds_config.json (path or dict)")
        # accelerate's DeepSpeed plugin cannot run a PipelineModule: keep the config away from it.
        self.deepspeed = None
        if not torch.cuda.is_available():
            self.use_cpu = True  # else accelerate sees no device and no distributed run (process_index 0 everywhere)
        _init_distributed()
        super().__post_init__()
        self.recycle_ds_config = _load_ds_config(self.recycle_ds_config_source)
        self.leader: Callable[[], bool] | None = None
        """Set by RecycleTrainer: True on the engine's lowest live rank."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["leader"] = None  # a bound method of the trainer: never pickled with the arguments
        return state

    @property
    def should_log(self) -> bool:
        return self.leader() if self.leader is not None else super().should_log

    @property
    def should_save(self) -> bool:
        return self.leader() if self.leader is not None else super().should_save

    def pipeline_stages(self) -> int:
        stages = self.pipeline_parallel_size
        from_config = self.recycle_ds_config.get("pipeline", {}).get("stages", AUTO)
        if stages is None:
            if from_config == AUTO:
                raise DeepSpeedArgumentsError(
                    "the number of pipeline stages is unknown: set pipeline.stages in the ds_config or "
                    "--pipeline_parallel_size"
                )
            stages = from_config
        elif from_config not in (AUTO, stages):
            raise DeepSpeedArgumentsError(
                f"ds_config pipeline.stages={from_config} but RecycleTrainingArguments pipeline_parallel_size={stages}"
            )
        return int(stages)

    def filled_ds_config(self, data_parallel_size: int, max_steps: int, warmup_steps: int) -> dict:
        """The ds_config with every ``"auto"`` filled from these arguments; values set in both
        places must agree."""
        return fill_ds_config(self.recycle_ds_config, self, data_parallel_size, max_steps, warmup_steps)


def fill_ds_config(
    ds_config: Mapping[str, Any], args: TrainingArguments, data_parallel_size: int, max_steps: int, warmup_steps: int
) -> dict:
    """Fill ``"auto"`` values of a pipeline ds_config from HF arguments, as HF's own DeepSpeed
    integration does, but with ``train_batch_size = micro batch x accumulation x D`` where D is the
    number of pipelines (not the world size). Raises :class:`DeepSpeedArgumentsError` listing
    every key whose explicit value contradicts its argument."""
    config = json.loads(json.dumps(ds_config))
    mismatches: list[str] = []

    def fill(path: str, arg_name: str, value: Any, *, must_match: bool = True) -> None:
        *parents, key = path.split(".")
        section = config
        for part in parents:
            section = section.get(part)
            if not isinstance(section, dict):
                return
        if key not in section:
            section[key] = value
        elif section[key] == AUTO:
            section[key] = value
        elif must_match and section[key] != value:
            mismatches.append(f"ds_config {path}={section[key]!r} but TrainingArguments {arg_name}={value!r}")

    if args.fp16 or args.bf16:
        raise DeepSpeedArgumentsError(
            "ReCycle trains in fp32 (DeepSpeed's fp16/bf16 optimizers shard state across replicas): drop --fp16/--bf16"
        )
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", "per_device_train_batch_size", mbs)
    fill("gradient_accumulation_steps", "gradient_accumulation_steps", gas)
    fill(
        "train_batch_size",
        f"per_device_train_batch_size x gradient_accumulation_steps x pipelines ({mbs} x {gas} x {data_parallel_size})",
        mbs * gas * data_parallel_size,
    )
    fill("gradient_clipping", "max_grad_norm", args.max_grad_norm)
    fill("dataloader_drop_last", "dataloader_drop_last", args.dataloader_drop_last)
    fill("fp16.enabled", "fp16", bool(args.fp16))
    fill("bf16.enabled", "bf16", bool(args.bf16))
    if isinstance(config.get("optimizer"), dict):
        config["optimizer"].setdefault("params", {})
        fill("optimizer.params.lr", "learning_rate", args.learning_rate)
        fill("optimizer.params.betas", "adam_beta1, adam_beta2", [args.adam_beta1, args.adam_beta2])
        fill("optimizer.params.eps", "adam_epsilon", args.adam_epsilon)
        fill("optimizer.params.weight_decay", "weight_decay", args.weight_decay)
    if isinstance(config.get("scheduler"), dict):
        config["scheduler"].setdefault("params", {})
        params = config["scheduler"]["params"]
        for key, arg_name, value in (
            ("warmup_max_lr", "learning_rate", args.learning_rate),
            ("warmup_num_steps", "warmup_steps", warmup_steps),
            ("total_num_steps", "max_steps", max_steps),
        ):
            if params.get(key) == AUTO:
                params[key] = value
            elif key in params and params[key] != value and key != "total_num_steps":
                mismatches.append(
                    f"ds_config scheduler.params.{key}={params[key]!r} but TrainingArguments {arg_name}={value!r}"
                )
        if params.get("warmup_min_lr") == AUTO:
            params["warmup_min_lr"] = 0
    stages = config.get("pipeline", {}).get("stages")
    if stages == AUTO:
        config["pipeline"].pop("stages")
    if mismatches:
        raise DeepSpeedArgumentsError(
            'the DeepSpeed config and the TrainingArguments disagree (use "auto" in the ds_config to take the '
            "argument's value):\n  " + "\n  ".join(mismatches)
        )
    return config


# ---- trainer -----------------------------------------------------------------------------------


class RecycleTrainer(Trainer):
    """``Trainer`` whose optimizer steps are ReCycle pipeline iterations (``engine.train_batch``)."""

    args: RecycleTrainingArguments

    def __init__(self, model=None, args: RecycleTrainingArguments | None = None, *pargs, **kwargs):
        if not isinstance(args, RecycleTrainingArguments):
            raise TypeError(f"RecycleTrainer needs RecycleTrainingArguments, got {type(args).__name__}")
        self.hf_config = getattr(model, "config", model if isinstance(model, PretrainedConfig) else None)
        model = self._as_pipeline(model, args)
        self.engine = None
        super().__init__(model, args, *pargs, **kwargs)
        self.hf_config = self.hf_config or getattr(getattr(model, "hf", None), "config", None)
        args.leader = self.is_world_process_zero

    @staticmethod
    def _as_pipeline(model, args: RecycleTrainingArguments) -> PipelineModule:
        if isinstance(model, PipelineModule):
            return model
        stages = args.pipeline_stages()
        if isinstance(model, PretrainedConfig):
            return causal_lm_pipeline(model, stages, partition_method=args.pipeline_partition_method, seed=args.seed)
        if isinstance(model, PreTrainedModel):
            pipe = causal_lm_pipeline(
                model.config, stages, partition_method=args.pipeline_partition_method, seed=args.seed
            )
            load_hf_state_dict(pipe, model.state_dict())
            return pipe
        raise TypeError(
            "RecycleTrainer's model must be a PipelineModule, a PreTrainedModel or a PretrainedConfig, "
            f"got {type(model).__name__}"
        )

    # ---- who logs and saves ---------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """The engine's lowest live rank (before the engine exists: rank 0)."""
        if self.engine is None:
            return super().is_world_process_zero()
        return _leads(self.engine)

    def _follow_leader(self) -> None:
        """After a membership change the leader may be a new process: give it the progress bar, and
        let HF's ``WandbCallback`` open (resume) the job's run on it."""
        leader = self.is_world_process_zero()
        if leader == self.state.is_world_process_zero:
            return
        self.state.is_world_process_zero = leader
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and leader and callback.training_bar is None:
                callback.on_train_begin(self.args, self.state, self.control)
                callback.current_step = self.state.global_step
            if isinstance(callback, WandbCallback) and leader and getattr(callback._wandb, "run", None) is None:
                callback._initialized = False  # set up again (wandb.init) on its next on_log

    # ---- data ---------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """One tick per micro-batch of this rank's pipeline, one epoch as long as DeepSpeed's
        pipeline loader's epoch; the engine loads the micro-batches themselves."""
        if self.train_dataset is None:
            raise ValueError("RecycleTrainer: training requires a train_dataset")
        if not (hasattr(self.train_dataset, "__getitem__") and hasattr(self.train_dataset, "__len__")):
            raise TypeError("RecycleTrainer needs a map-style train_dataset (any pipeline must load any micro-batch)")
        stages = self.model._topo.get_dim("pipe")
        pipelines = self.model._topo.get_dim("data")
        per_pipeline = math.ceil(len(self.train_dataset) / pipelines)
        micro_batches = per_pipeline // self.args.per_device_train_batch_size
        gas = self.args.gradient_accumulation_steps
        ticks = micro_batches - micro_batches % gas
        if ticks == 0:
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} samples: fewer than one step of {pipelines} pipelines x "
                f"{gas} micro-batches x {self.args.per_device_train_batch_size} (stages: {stages})"
            )
        return DataLoader(_Ticks(ticks), batch_size=1, collate_fn=_only)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.model._topo.get_dim("data")

    def _pipeline_collate(self, samples: list) -> tuple:
        return pipeline_batch(self.data_collator(samples))

    # ---- engine -------------------------------------------------------------------------------

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ) -> tuple[int, int]:
        """As Trainer's; in a process that re-joins a running job (a respawn under ``ds-recycle
        launch``), the engine is made here, so that the loop starts where the job is."""
        trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        from ds_recycle.runtime.rank.distributed import membership_agent

        agent = membership_agent()
        if agent is None or not agent.is_joiner:
            self._joined = False
            return trained
        self._start_engine(max_steps)
        self._joined = True
        return self._take_up_job(max_steps, num_update_steps_per_epoch, num_train_epochs, trial)

    def _take_up_job(self, max_steps, num_update_steps_per_epoch, num_train_epochs, trial) -> tuple[int, int]:
        """The Trainer's state follows the engine this process joined: the replica's TrainerState
        (log history, flos, callbacks' state), the global step and epoch of the engine, and the
        position in the data (the loop skips the ticks of the steps already trained)."""
        received = self.engine.received_client_state or {}
        if "trainer_state" in received:
            self.state = TrainerState(**json.loads(received["trainer_state"]))
            self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        for callback in self.callback_handler.callbacks + [self.control]:
            stored = received.get("callbacks", {}).get(type(callback).__name__)
            if isinstance(callback, ExportableState) and stored is not None:
                for name, value in stored.get("attributes", {}).items():
                    setattr(callback, name, value)
        step = self.engine.global_steps
        self._join_step = received.get("step")
        self.state.global_step = step
        self.state.epoch = step / num_update_steps_per_epoch
        logger.info(
            f"RecycleTrainer: re-joined at step {step} (epoch {self.state.epoch:.2f}); the Trainer continues from there"
        )
        return step // num_update_steps_per_epoch, (
            step % num_update_steps_per_epoch
        ) * self.args.gradient_accumulation_steps

    def _run_epoch(self, *args, **kwargs):
        """A joiner skips the ticks of the steps trained before it joined, as a resumed run does,
        and first ends the step it joined at as every other rank does (log, save, callbacks)."""
        if getattr(self, "_joined", False) and kwargs.get("resume_from_checkpoint") is None:
            kwargs["resume_from_checkpoint"] = _JOINED
            if getattr(self, "_join_step", None) is not None:
                self._end_join_step(kwargs)
        return super()._run_epoch(*args, **kwargs)

    def _end_join_step(self, loop: dict) -> None:
        """The step a joiner was admitted at ended on the others after the admission: its loss
        is still to be logged (by the leader, which may be this process) and its checkpoint to be
        saved (a collective of every rank). Do here what the others do at the end of that step."""
        pending = self._join_step
        self._join_step = None
        self._tr_loss = torch.tensor(pending["tr_loss"], device=self.args.device)
        self._globalstep_last_logged = pending["last_logged"]
        self._step_lr = pending["learning_rate"]
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        grad_norm = pending["grad_norm"]
        self._maybe_log_save_evaluate(
            self._tr_loss,
            grad_norm,
            self.model_wrapped,
            loop.get("trial"),
            loop.get("epoch"),
            loop.get("ignore_keys_for_eval"),
            loop.get("start_time"),
            learning_rate=pending["learning_rate"],
        )

    def _load_rng_state(self, checkpoint) -> None:
        if checkpoint is not _JOINED:
            super()._load_rng_state(checkpoint)

    def _client_state(self) -> dict:
        """What a joiner takes up from this process (``engine.rejoin_client_state``)."""
        callbacks = {
            type(c).__name__: c.state()
            for c in self.callback_handler.callbacks + [self.control]
            if isinstance(c, ExportableState)
        }
        # Called inside train_batch, at the boundary after the joiner's admission step, before this
        # Trainer counts, logs and saves that step: the joiner ends it from what it gets here.
        step = {
            "tr_loss": float(self._tr_loss) + float(self.engine.agg_train_loss),
            "last_logged": self._globalstep_last_logged,
            "learning_rate": self._get_learning_rate(),
            "grad_norm": self._get_grad_norm(self.model_wrapped),
        }
        return {"trainer_state": json.dumps(dataclasses.asdict(self.state)), "callbacks": callbacks, "step": step}

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.engine is None:
            self._start_engine(max_steps)
        engine = self.engine
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint (latest, global_step*/) in {resume_from_checkpoint}")
            if engine.global_steps != self.state.global_step:
                raise RuntimeError(
                    f"{resume_from_checkpoint}: the DeepSpeed checkpoint is at step {engine.global_steps} but "
                    f"trainer_state.json at step {self.state.global_step}"
                )
        self.state.is_world_process_zero = self.is_world_process_zero()
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _start_engine(self, max_steps: int) -> None:
        """The ReCycle engine (in a joiner: admitted, holding a live replica's state)."""
        import ds_recycle

        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        pipelines = self.model._topo.get_dim("data")
        config = self.args.filled_ds_config(pipelines, max_steps, self.args.get_warmup_steps(max_steps))
        optimizer = None if "optimizer" in config else self.create_optimizer()
        scheduler = None
        if "scheduler" not in config:
            if optimizer is None:
                raise DeepSpeedArgumentsError(
                    "the ds_config has an optimizer but no scheduler: add a 'scheduler' section, or remove "
                    "'optimizer' to use the TrainingArguments' optimizer and lr_scheduler_type"
                )
            scheduler = self.create_scheduler(max_steps, optimizer)
        engine, engine_optimizer, _, engine_scheduler = ds_recycle.initialize(
            model=self.model,
            optimizer=optimizer,
            model_parameters=[p for p in self.model.parameters() if p.requires_grad],
            lr_scheduler=scheduler,
            training_data=self.train_dataset,
            collate_fn=self._pipeline_collate,
            config=config,
        )
        self.engine = self.deepspeed = engine
        self.model_wrapped = engine
        if "wandb" in (self.args.report_to or []):
            self._share_wandb_run(config)
        self._own_data = getattr(engine, "micro_batch_source", None) or _own_micro_batches(
            engine, self.train_dataset, self._pipeline_collate
        )
        self._window: list = []
        # The engine steps both; Trainer's calls become no-ops.
        self.optimizer = _EngineOwned(engine_optimizer)
        self.lr_scheduler = _EngineOwned(engine_scheduler) if engine_scheduler is not None else _ConstantLR(engine)
        if hasattr(engine, "rejoin_client_state"):
            engine.rejoin_client_state = self._client_state

    def _share_wandb_run(self, config: Mapping) -> None:
        """HF's ``WandbCallback`` opens the run of ``recycle.monitor.wandb`` (its id, project and
        mode: offline without an API key), and a leader that takes over resumes the same run id."""
        settings = RecycleConfig.from_ds_config(config).monitor.wandb
        share_run_through_environment(
            settings or WandbMonitorConfig(project=os.environ.get("WANDB_PROJECT", "huggingface"))
        )

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Collect one tick per micro-batch; on the last of the step run ``engine.train_batch``.
        The returned losses sum to the step's loss (the mean over all D x m micro-batches)."""
        self._window.append(inputs["tick"])
        gas = self.args.gradient_accumulation_steps
        if len(self._window) < gas:
            return torch.zeros((), device=self.args.device)
        self._window = []
        engine = self.engine
        if engine.global_steps != self.state.global_step:
            raise RuntimeError(
                f"the Trainer is at step {self.state.global_step} but the engine at {engine.global_steps}"
            )
        iteration, home = engine.global_steps, engine.grid.get_data_parallel_id()
        own = iter([self._own_data(iteration, home, mb) for mb in range(gas)])
        self._step_lr = self.lr_scheduler.get_last_lr()[0]
        loss = engine.train_batch(own)
        self._follow_leader()
        return loss.detach().to(self.args.device).float()

    def _get_learning_rate(self) -> float:
        """The lr this step ran with (the engine has already stepped the scheduler)."""
        lr = getattr(self, "_step_lr", None)
        return float(lr) if lr is not None else float(self.lr_scheduler.get_last_lr()[0])

    def _clip_grad_norm(self, model) -> float | None:
        """The engine clipped already; report its global norm over all stages."""
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None) -> float | None:
        stepper = getattr(self.engine, "stepper", None)
        norm = getattr(stepper, "last_grad_norm", None)
        if norm is None:
            norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, **kw):
        """As Trainer's, without the all-gather of the loss: every rank already holds the global
        loss, and a world collective at each log would have to run on every survivor."""
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            loss = tr_loss.item()
            tr_loss -= tr_loss
            steps = self.state.global_step - self._globalstep_last_logged
            logs: dict[str, float] = {"loss": loss / steps}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            learning_rate = kw.get("learning_rate")
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            self._total_loss_scalar += loss
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
        if self.control.should_evaluate:
            metrics = self._evaluate(trial, ignore_keys_for_eval)
            is_new_best_metric = self._determine_best_metric(metrics=metrics, trial=trial)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_new_best_metric
        if self.control.should_save:
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # ---- evaluation ---------------------------------------------------------------------------

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """The eval set, held for :meth:`evaluation_loop` (which loads its micro-batches itself)."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        return _held(eval_dataset if eval_dataset is not None else self.eval_dataset)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return _held(test_dataset)

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Shared by ``evaluate()`` and ``predict()``: ``engine.eval_batch`` over the eval set, every
        rank in step (each batch runs on the live workers' forward-only plan)."""
        if self.compute_metrics is not None:
            raise NotImplementedError(
                "RecycleTrainer evaluates the loss only (predictions stay on the last stage and are not gathered): "
                "drop compute_metrics, or compute metrics from the saved model"
            )
        dataset = dataloader.dataset
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError("RecycleTrainer needs a map-style eval dataset (any pipeline must load any micro-batch)")
        if self.engine is None:
            self._start_engine(self._planned_max_steps())
        engine = self.engine
        micro_batches = EvalMicroBatches(
            dataset,
            pipelines=engine.grid.data_parallel_size,
            micro_batches=engine.micro_batches,
            micro_batch_size=engine.train_micro_batch_size_per_gpu(),
            collate_fn=self._pipeline_collate,
        )
        if self.args.per_device_eval_batch_size != micro_batches.micro_batch_size:
            logger.warning_once(
                f"RecycleTrainer evaluates in micro-batches of the training's {micro_batches.micro_batch_size} "
                f"samples (the pipeline's activations keep one shape), not per_device_eval_batch_size="
                f"{self.args.per_device_eval_batch_size}"
            )
        if micro_batches.left_out:
            logger.warning_once(
                f"RecycleTrainer: the last {micro_batches.left_out} of {len(dataset)} eval samples do not fill a "
                f"micro-batch of every pipeline and are not evaluated"
            )
        logger.info(f"***** Running {description} *****")
        logger.info(f"  Num examples = {micro_batches.samples}")
        weighted, counted = 0.0, 0
        for step, count in enumerate(micro_batches.steps()):
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            loss = engine.eval_batch(micro_batches.source(step), num_micro_batches=count)
            weighted += float(loss) * count
            counted += count
        metrics: dict[str, float] = {}
        if counted:
            metrics[f"{metric_key_prefix}_loss"] = weighted / counted
        self._follow_leader()
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=micro_batches.samples)

    def _planned_max_steps(self) -> int:
        """The number of steps ``train()`` will run (the engine's LR schedule needs it), for an
        evaluation before training."""
        if self.args.max_steps > 0 or self.train_dataset is None:
            return max(self.args.max_steps, 1)
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def store_flos(self) -> None:
        self.state.total_flos += self.current_flos
        self.current_flos = 0

    # ---- checkpoints --------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Weights, optimizer and scheduler come back through ``engine.load_checkpoint``."""

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """Part of the DeepSpeed checkpoint."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        """HF's ``checkpoint-N``, whole through a failure while it is written: the survivors
        recover and write it again (``engine.between_iterations``)."""
        self.engine.between_iterations(
            lambda: super(RecycleTrainer, self)._save_checkpoint(model, trial),
            f"the Trainer's checkpoint-{self.state.global_step}",
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A HF checkpoint that ``from_pretrained`` loads: one safetensors shard per stage (written
        by the stage's first data-parallel replica, with HF names), then the index and
        ``config.json`` from the leader. Call it on every rank."""
        output_dir = output_dir or self.args.output_dir
        if self.engine is None:
            raise RuntimeError("save_model needs the engine: call train() first")
        save_hf_checkpoint(self.engine, self.model, self.hf_config, output_dir)
        if self.processing_class is not None and self.is_world_process_zero():
            self.processing_class.save_pretrained(output_dir)
        if self.is_world_process_zero():
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def save_hf_checkpoint(engine, module: PipelineModule, hf_config, output_dir: str, leader: bool | None = None) -> None:
    """Write ``module``'s weights (all stages) as a sharded HF safetensors checkpoint; call it on
    every rank. ``leader``: whether this rank writes the index and ``config.json`` (default: the
    engine's lowest live rank). A ReCycle engine survives a failure during it and writes it again
    on the new plan, leader and writers chosen anew."""
    write = functools.partial(_write_hf_checkpoint, engine, module, hf_config, output_dir, leader)
    between = getattr(engine, "between_iterations", None)
    if between is None:
        return write()
    return between(write, f"the HF checkpoint in {output_dir}")


def _leads(engine) -> bool:
    """Whether this rank is the one that logs and saves: the engine's lowest live rank (a stock
    DeepSpeed engine's rank 0)."""
    lowest = getattr(engine, "is_lowest_live_rank", None)
    return lowest() if lowest is not None else engine.global_rank == 0


def _write_hf_checkpoint(engine, module: PipelineModule, hf_config, output_dir: str, leader: bool | None) -> None:
    from deepspeed import comm as dist
    from safetensors import safe_open
    from safetensors.torch import save_file

    if leader is None:
        leader = _leads(engine)
    stages = engine.num_stages
    shard = f"model-{engine.stage_id + 1:05d}-of-{stages:05d}.safetensors"
    os.makedirs(output_dir, exist_ok=True)
    grid = engine.grid
    live = grid.live_workers(engine.stage_id) if hasattr(grid, "live_workers") else None
    if (live[0] == grid.worker) if live else grid.get_data_parallel_rank() == 0:  # the stage's lowest live replica
        tensors = {k: v.detach().contiguous().cpu().clone() for k, v in to_hf_state_dict(module).items()}
        save_file(tensors, os.path.join(output_dir, shard), metadata={"format": "pt"})
    Waiter.stop_if_abandoned(f"the HF checkpoint in {output_dir}")  # its barrier would be the new world's
    dist.barrier()
    if not leader:
        return
    weight_map, total = {}, 0
    for stage in range(stages):
        name = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
        with safe_open(os.path.join(output_dir, name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                tensor = f.get_slice(key)
                total += math.prod(tensor.get_shape()) * _DTYPE_BYTES[tensor.get_dtype()]
    with open(os.path.join(output_dir, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    if hf_config is not None:
        hf_config.save_pretrained(output_dir)


# ---- helpers -----------------------------------------------------------------------------------


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class _Ticks(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"tick": index}


def _only(items: list) -> Any:
    return items[0]


class _EngineOwned:
    """The engine's optimizer or scheduler as Trainer sees it: ``step`` is a no-op (the engine
    steps inside ``train_batch``), everything else is the real object."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def step(self, *args, **kwargs) -> None:
        return None

    def zero_grad(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._target, name)


@dataclass
class _ConstantLR:
    """A scheduler-like view when the engine has no scheduler: the optimizer's current lr."""

    engine: Any

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.engine.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}


@dataclass
class EvalMicroBatches:
    """An eval set as ``eval_batch`` steps: micro-batches of ``micro_batch_size`` consecutive
    samples; step t gives pipeline h its micro-batches k < m_t, samples from
    ``(first_t + h m_t + k) x micro_batch_size`` on. Every sample is in one micro-batch, except
    the last ones that cannot fill a micro-batch of every pipeline."""

    dataset: Any
    pipelines: int
    micro_batches: int
    micro_batch_size: int
    collate_fn: Callable

    def __post_init__(self) -> None:
        whole = len(self.dataset) // self.micro_batch_size
        self.per_pipeline = whole // self.pipelines
        self.samples = self.per_pipeline * self.pipelines * self.micro_batch_size
        self.left_out = len(self.dataset) - self.samples

    def steps(self) -> list[int]:
        """The micro-batches per pipeline of each step."""
        full, rest = divmod(self.per_pipeline, self.micro_batches)
        return [self.micro_batches] * full + ([rest] if rest else [])

    def source(self, step: int) -> Callable[[int, int], Any]:
        count = self.steps()[step]
        first = step * self.micro_batches * self.pipelines

        def load(home: int, mb: int):
            start = (first + home * count + mb) * self.micro_batch_size
            return self.collate_fn([self.dataset[i] for i in range(start, start + self.micro_batch_size)])

        return load


def _held(dataset) -> DataLoader:
    """A DataLoader that only carries ``dataset`` to the evaluation loop: it is never iterated."""
    return DataLoader(dataset, batch_size=1, collate_fn=_only)


def _own_micro_batches(engine, dataset, collate_fn) -> Callable:
    """DeepSpeed's pipeline-loader mapping when the engine has no micro-batch source (ReCycle off)."""
    from ds_recycle.data import DatasetMicroBatches

    return DatasetMicroBatches(
        dataset,
        pipelines=engine.grid.get_data_parallel_world_size(),
        micro_batches=engine.gradient_accumulation_steps(),
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        collate_fn=collate_fn,
        drop_last=engine.dataloader_drop_last(),
    )


def _load_ds_config(source) -> dict:
    if isinstance(source, Mapping):
        return json.loads(json.dumps(source))
    with open(source) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise DeepSpeedArgumentsError(f"{source}: a DeepSpeed config must be a JSON object")
    if "recycle" in config and not isinstance(config["recycle"], dict):
        raise RecycleConfigError("'recycle' must be an object")
    return config


def _init_distributed() -> None:
    """Start torch.distributed as ``ds_recycle.init_distributed`` does (under ``ds-recycle launch``
    it joins the coordinator), before accelerate would start it on its own."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "MASTER_ADDR" not in os.environ:
        return
    import ds_recycle

    ds_recycle.init_distributed()
