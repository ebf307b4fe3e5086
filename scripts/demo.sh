#!/usr/bin/env bash
# The main job on CPU: a tiny GPT, pipeline 2 x data 2, through the stock deepspeed launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
exec .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py --deepspeed_config ds_configs/gpt_recycle.json "$@"
