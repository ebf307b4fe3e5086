#!/usr/bin/env bash
# Create (or reuse) .venv and install ds_recycle with its test and hf extras.
# torch==2.13.0 goes first: it is the CPU wheel here, and installing it first keeps the
# `torch>=2.13` requirement of deepspeed and ds_recycle from pulling a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[test,hf]"
# DeepSpeed builds its CPU shared-memory comm op on the first engine start. Build it here, once, in a
# cache of this venv's own (scripts/test.sh uses the same): a rank killed mid-build (a failure test)
# leaves the build's lock behind, and every later rank that shares the cache waits on it forever.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
