#!/usr/bin/env bash
# The test suite: pure tests, then real multi-process DeepSpeed engines on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"  # see bootstrap.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
