#!/usr/bin/env bash
# The test suite: pure tests, then real multi-process DeepSpeed engines on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
