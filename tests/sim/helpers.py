"""Small jobs for the simulator tests (each planned in milliseconds)."""

from __future__ import annotations

from dataclasses import replace

from ds_recycle.sim.job import Checkpointing, Job
from ds_recycle.sim.presets import get_model


def small_job(D: int = 4, P: int = 4, m: int = 8, model: str = "1.3B", interval: float | None = 1800.0, **kw) -> Job:
    return Job(get_model(model), D, P, m, checkpointing=Checkpointing(60.0, 300.0, interval), **kw)


def balanced_job(D: int = 4, P: int = 4, m: int = 8) -> Job:
    """B + W equal to the fused backward (fp32-like), so that decoupling itself costs nothing."""
    spec = get_model("1.3B")
    spec = replace(spec, name="balanced", fused_ms=spec.B_ms + spec.W_ms)
    return Job(spec, D, P, m, checkpointing=Checkpointing(60.0, 300.0, 1800.0))
