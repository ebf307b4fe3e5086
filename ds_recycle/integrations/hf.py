"""HuggingFace integration: a causal LM as a ReCycle pipeline, trained through ``transformers.Trainer``.

Needs the ``hf`` extra (``pip install 'ds-recycle[hf]'``).
"""

from __future__ import annotations

from ds_recycle.integrations.hf_model import (
    CausalLMPipelineInfo,
    HFNames,
    HFPipelineError,
    causal_lm_pipeline,
    from_hf_state_dict,
    load_hf_state_dict,
    pipeline_batch,
    to_hf_state_dict,
)
from ds_recycle.integrations.hf_trainer import (
    DeepSpeedArgumentsError,
    RecycleTrainer,
    RecycleTrainingArguments,
    fill_ds_config,
    save_hf_checkpoint,
)

__all__ = [
    "DeepSpeedArgumentsError",
    "RecycleTrainer",
    "RecycleTrainingArguments",
    "fill_ds_config",
    "save_hf_checkpoint",
    "CausalLMPipelineInfo",
    "HFNames",
    "HFPipelineError",
    "causal_lm_pipeline",
    "from_hf_state_dict",
    "load_hf_state_dict",
    "pipeline_batch",
    "to_hf_state_dict",
]
