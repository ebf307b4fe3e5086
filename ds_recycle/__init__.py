"""ds_recycle: ReCycle for DeepSpeed pipelines.

``ds_recycle.initialize`` takes the arguments of ``deepspeed.initialize`` and returns the same
tuple. For a ``PipelineModule`` the engine is a :class:`RecyclePipelineEngine`.
"""

from __future__ import annotations

from ds_recycle.config import RecycleConfig, RecycleConfigError
from ds_recycle.engine import RecyclePipelineEngine
from ds_recycle.initialize import initialize

__all__ = ["RecycleConfig", "RecycleConfigError", "RecyclePipelineEngine", "initialize"]
