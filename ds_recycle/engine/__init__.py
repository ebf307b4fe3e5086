"""The ReCycle pipeline engine and its pieces."""

from ds_recycle.engine.pipeline_engine import RecyclePipelineEngine

__all__ = ["RecyclePipelineEngine"]
