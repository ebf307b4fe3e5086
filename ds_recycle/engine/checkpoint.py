"""Checkpointer: ``recycle.checkpoint``'s DeepSpeed checkpoints, which a degraded job can still
write and restart from.

DeepSpeed writes a stage's files from its data-parallel rank 0 and the ``latest`` tag from global
rank 0. After a failure those may be dead, so while workers are missing the lowest live replica
of each stage writes its stage (``StageWriterView`` is what DeepSpeed's layer writer sees as the
grid) and the lowest live rank writes ``latest`` (:mod:`ds_recycle.runtime.rank.checkpoints`). The
files are DeepSpeed's own: ``engine.load_checkpoint(dir)`` reads them in any process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from deepspeed.runtime.pipe.engine import PipelineEngine

from ds_recycle.log import logger
from ds_recycle.runtime.rank import checkpoints, exit_guard
from ds_recycle.runtime.rank.waiting import Waiter
from ds_recycle.runtime.shared import keys


@dataclass(frozen=True)
class StageWriterView:
    """What ``PipelineModule.save_state_dict`` reads from its grid: the data-parallel rank and size
    counted among the live replicas of this stage (the lowest live one is rank 0 and writes), and
    the job's topology, which names the layer files."""

    data_parallel_id: int
    data_parallel_size: int
    _topo: object


def writer_view(grid, topology) -> StageWriterView:
    pipeline, stage = grid.worker
    live = [p for p, _ in grid.live_workers(stage)]
    return StageWriterView(live.index(pipeline), len(live), topology)


class Checkpointer:
    """Saves and resumes the engine's checkpoints (see the module doc). ``deepspeed_save`` is
    DeepSpeed's own ``save_checkpoint`` of the engine."""

    def __init__(self, engine: PipelineEngine, deepspeed_save: Callable) -> None:
        self.engine = engine
        """The :class:`~ds_recycle.engine.pipeline_engine.RecyclePipelineEngine` it saves."""
        self.config = engine.recycle.checkpoint
        self._save = deepspeed_save

    def save(self, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool):
        engine = self.engine
        tag = str(tag or f"global_step{engine.global_steps}")
        Waiter.stop_if_abandoned(f"the checkpoint {tag}")  # before DeepSpeed's first barrier
        if not engine.grid.failed:
            saved = self._save(save_dir, tag, client_state, False, exclude_frozen_parameters)
        else:
            view = writer_view(engine.grid, engine.module._topo)
            os.makedirs(save_dir, exist_ok=True)
            writes, grid = engine.save_non_zero_checkpoint, engine.module._grid
            engine.save_non_zero_checkpoint, engine.module._grid = view.data_parallel_id == 0, view
            try:
                saved = self._save(save_dir, tag, client_state, False, exclude_frozen_parameters)
            finally:
                engine.save_non_zero_checkpoint, engine.module._grid = writes, grid
        if save_latest and engine.is_lowest_live_rank():
            checkpoints.write_latest(save_dir, tag)
        return saved

    def save_if_due(self) -> None:
        if checkpoints.due(self.config, self.engine.global_steps):
            self.engine.save_checkpoint(self.config.dir)

    def resume(self) -> None:
        """At start: continue from the latest checkpoint in ``recycle.checkpoint.dir``, if any. In a
        restart of the whole job (``DS_RECYCLE_RESUME=required``: generation > 0) there must be one:
        without it the rank stops the job (exit 76) rather than train again from scratch."""
        engine, config = self.engine, self.config
        tag = checkpoints.latest_tag(config)
        if tag is None and os.environ.get(keys.ENV_RESUME) == "required":
            where = "no recycle.checkpoint is configured" if config is None else f"no checkpoint in {config.dir}"
            logger.error(
                f"ReCycle: slot {engine.slot}: the job restarts in generation {os.environ.get(keys.ENV_GENERATION)} "
                f"(the coordinator's host died, or a stage lost every worker), but {where} to resume from: "
                "the job stops here"
            )
            raise exit_guard.exit(keys.STOP_EXIT_CODE)
        if tag is None:
            return
        engine.load_checkpoint(config.dir, tag)
        logger.info(
            f"ReCycle: slot {engine.slot} resumed from checkpoint {tag} in {config.dir} "
            f"at iteration {engine.global_steps}"
        )
