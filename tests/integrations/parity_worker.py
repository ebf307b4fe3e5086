"""One process (a gloo world of 1): build each tiny config both as ``causal_lm_pipeline(config, 1)``
and as ``AutoModelForCausalLM.from_config(config)`` with the pipeline's weights, run a padded batch
through both, and write what the test asserts as JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from tiny_configs import CONFIGS, VOCAB  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ds_recycle.integrations.hf import (  # noqa: E402
    causal_lm_pipeline,
    from_hf_state_dict,
    pipeline_batch,
    to_hf_state_dict,
)


def check(name: str) -> dict:
    config = CONFIGS[name]()
    pipe = causal_lm_pipeline(config, num_stages=1, seed=7)
    again = causal_lm_pipeline(config, num_stages=1, seed=7)
    ref = AutoModelForCausalLM.from_config(config)
    hf_state = to_hf_state_dict(pipe)
    missing, unexpected = ref.load_state_dict(hf_state, strict=False)
    back = from_hf_state_dict(pipe, ref.state_dict())
    ref.eval()
    pipe.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    ids = ids.masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask}
    inputs, labels = pipeline_batch(batch)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, labels=labels)
        logits = pipe(inputs)
        loss = pipe.loss_fn(logits, labels)
        unpadded = ref(input_ids=ids[:1], labels=ids[:1])
        pipe_unpadded = pipe(pipeline_batch({"input_ids": ids[:1]})[0])
    stds = {
        n: float(p.std())
        for n, p in ref.named_parameters()
        if p.dim() == 2 and "wpe" not in n and n != "lm_head.weight"
    }
    return {
        "missing": missing,
        "unexpected": unexpected,
        "tied": pipe.hf.tied,
        "ref_tied": ref.lm_head.weight is ref.get_input_embeddings().weight,
        "logits_equal": torch.equal(out.logits, logits),
        "loss_equal": torch.equal(out.loss, loss),
        "max_abs_diff": float((out.logits - logits).abs().max()),
        "unpadded_equal": torch.equal(unpadded.logits, pipe_unpadded),
        "loss": float(loss),
        "roundtrip": sorted(back) == sorted(pipe.state_dict())
        and all(torch.equal(back[k], v) for k, v in pipe.state_dict().items()),
        "deterministic": all(torch.equal(v, again.state_dict()[k]) for k, v in pipe.state_dict().items()),
        "stds": stds,
        "initializer_range": config.initializer_range,
    }


def main() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = {name: check(name) for name in CONFIGS}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
