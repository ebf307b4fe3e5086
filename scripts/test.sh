#!/usr/bin/env bash
# The test suite: pure tests, then real multi-process DeepSpeed engines on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"  # see bootstrap.sh
# Two workers: the multiprocess tests one after the other on one, the pure tests on the other
# (tests/conftest.py). Arguments after the script's name go to pytest (-n 0: serial).
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "$@"
