"""``recycle.checkpoint``: DeepSpeed checkpoints that a degraded job can still write and restart from.

DeepSpeed writes a stage's files from its data-parallel rank 0 and the ``latest`` tag from global
rank 0. After a failure those may be dead, so while workers are missing the lowest live replica
of each stage writes its stage (``StageWriterView`` is what DeepSpeed's layer writer sees as the
grid) and the lowest live rank writes ``latest``. The files are DeepSpeed's own:
``engine.load_checkpoint(dir)`` reads them in any process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ds_recycle.config import CheckpointConfig

LATEST = "latest"


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


def latest_tag(config: CheckpointConfig | None) -> str | None:
    """The tag of the latest complete checkpoint in ``config.dir``, or None."""
    if config is None:
        return None
    path = os.path.join(config.dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return tag or None


def write_latest(config_dir: str, tag: str) -> None:
    partial = os.path.join(config_dir, LATEST + ".partial")
    with open(partial, "w") as f:
        f.write(tag)
    os.replace(partial, os.path.join(config_dir, LATEST))


def due(config: CheckpointConfig | None, finished_iterations: int) -> bool:
    return config is not None and finished_iterations > 0 and finished_iterations % config.interval == 0
