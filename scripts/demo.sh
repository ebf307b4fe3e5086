#!/usr/bin/env bash
# The main job on CPU: a tiny GPT on 3 pipelines x 2 stages through ds-recycle launch; a worker is
# SIGKILLed mid-iteration, training goes on without it, it re-joins, and the run is compared with a
# fault-free run of the same job (about two minutes on 2 cores). Writes demo_out/demo.png.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
exec .venv/bin/python examples/failure_demo.py "$@"
