"""Small models built from configs, for tests, examples and benchmarks (no downloads)."""

from ds_recycle.models.gpt import GPTConfig, GPTReference, build_gpt_pipeline, lm_loss

__all__ = ["GPTConfig", "GPTReference", "build_gpt_pipeline", "lm_loss"]
