"""The ways a DeepSpeed script starts distributed training, under ``ds-recycle launch``: with
``ds_recycle.init_distributed()`` it trains and is protected; with DeepSpeed's own
``deepspeed.init_distributed()`` it would be silently unprotected (no leave on SIGTERM, no re-join),
so ``ds_recycle.initialize`` refuses at start, before any iteration, with one line that says what
to change, and the launcher does not respawn it."""

from __future__ import annotations

import json

import pytest

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES
from ds_recycle.testing.tiny import ds_config

pytestmark = pytest.mark.multiprocess

SCRIPT = """
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, torch
import ds_recycle
from ds_recycle.data import TokenWindowProvider, shipped_corpus_tokens
from ds_recycle.models import build_gpt_pipeline
from ds_recycle.testing.tiny import TINY_GPT

form, config = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
if form == "deepspeed":
    deepspeed.init_distributed(dist_backend="gloo")
else:
    ds_recycle.init_distributed()
tokenizer, tokens = shipped_corpus_tokens()
cfg = TINY_GPT.config(tokenizer.vocab_size)
model = build_gpt_pipeline(cfg, num_stages=2, seed=0)
provider = TokenWindowProvider(tokens, cfg.seq_len, config["train_micro_batch_size_per_gpu"], seed=0)
engine, *_ = ds_recycle.initialize(
    model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config, training_data=provider
)
while engine.global_steps < 2:
    engine.train_batch()
print("trained", engine.global_steps)
"""

CONFIG = ds_config(2, 0.0, {"enabled": True})


def run(tmp_path, form: str):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return launch(
        [str(script), form, json.dumps(CONFIG)],
        world_size=2,
        timeout=180,
        log_dir=tmp_path / "logs",
        preload=PRELOAD_MODULES,
    )


def test_ds_recycle_init_distributed_trains(tmp_path):
    results = run(tmp_path, "ds_recycle")
    assert [r.returncode for r in results] == [0, 0], results[0].log[-3000:]
    assert all("trained 2" in r.log for r in results)


def test_deepspeed_init_distributed_is_refused_at_start_with_what_to_change(tmp_path):
    results = run(tmp_path, "deepspeed")
    assert [r.returncode for r in results] == [76, 76], results[0].log[-3000:]
    for result in results:
        assert "call ds_recycle.init_distributed() instead of deepspeed.init_distributed()" in result.log
        assert "trained" not in result.log
