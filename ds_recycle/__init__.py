"""ds_recycle: ReCycle for DeepSpeed pipelines.

``ds_recycle.initialize`` takes the arguments of ``deepspeed.initialize`` and returns the same
tuple. For a ``PipelineModule`` the engine is a :class:`RecyclePipelineEngine`. Call
``ds_recycle.init_distributed()`` where a script would call ``deepspeed.init_distributed()``: under
``ds-recycle launch`` it joins the coordinator (and lets a respawned process re-join).

``ds_recycle.pipeline_major_topology(P, D)`` is the topology that keeps a pipeline on a node (a
node's loss then takes whole pipelines, never every replica of a stage).

The engine, ``initialize``, ``init_distributed`` and the topology are imported on first use, so that
``import ds_recycle.cli`` or ``ds_recycle.planner`` does not import DeepSpeed (seconds).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ds_recycle.config import RecycleConfig, RecycleConfigError

_LAZY = {
    "RecyclePipelineEngine": "ds_recycle.engine",
    "initialize": "ds_recycle.api",
    "init_distributed": "ds_recycle.api",
    "pipeline_major_topology": "ds_recycle.runtime.shared.placement",
}

__all__ = [
    "RecycleConfig",
    "RecycleConfigError",
    "RecyclePipelineEngine",
    "init_distributed",
    "initialize",
    "pipeline_major_topology",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_recycle' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
