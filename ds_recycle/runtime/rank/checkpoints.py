"""The latest complete checkpoint of ``recycle.checkpoint``, and what stopping means for the job.

A job that cannot go on in place (a stage lost every worker, or the plan of a failure set cannot
fit in memory) restarts every rank from the latest checkpoint (exit 75), or stops without one
(exit 76). ``latest`` names a checkpoint only once every file of it is written
(:func:`write_latest`, after DeepSpeed's last barrier), so it never names one a failure cut short.
"""

from __future__ import annotations

import os

from ds_recycle.config import CheckpointConfig

LATEST = "latest"


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


def after_stop(config: CheckpointConfig | None) -> str:
    """What happens to a job that cannot go on in place, given its checkpoints."""
    tag = latest_tag(config)
    if config is None:
        return "No checkpoint is configured (recycle.checkpoint), so the job stops here."
    if tag is None:
        return f"No checkpoint was written yet in {config.dir}, so the job stops here."
    return (
        f"Last checkpoint: {tag} in {config.dir}; ds-recycle launch --respawn restarts every rank from it "
        "(without --respawn the job ends with exit code 75)."
    )
