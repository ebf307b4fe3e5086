#!/usr/bin/env bash
# The test suite: pure tests and real multi-process DeepSpeed engines on gloo.
#   bash scripts/test.sh           the whole suite, in two pytest processes side by side: the tests
#                                  that start real ranks (marker multiprocess) one after the other,
#                                  and the pure tests beside them, on the CPU the jobs leave idle
#                                  while they wait on each other, then the multiprocess tests that
#                                  check no timing (benchmarks' smoke runs, fault-free bitwise
#                                  tests: marker beside); exit 0 only if both pass
#   bash scripts/test.sh ARGS...   one pytest process with these arguments
# PYTEST_ADDOPTS adds options to both (e.g. --durations=30).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"  # see bootstrap.sh
pytest=(.venv/bin/python -m pytest -q -rs -p no:cacheprovider)  # -rs: say why a test was skipped
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
# A hang outside any test (at exit, in a child process a test waits for) is ended by a bound on each
# run: SIGABRT, on which Python's fault handler (-X faulthandler) prints every thread's stack; the
# run then answers 124. A hung test is ended sooner, by pytest-timeout (pyproject.toml).
bounded() { timeout --signal=ABRT --kill-after=30 "$1" .venv/bin/python -X faulthandler "${pytest[@]:1}" "${@:2}"; }
PURE_BOUND_SECONDS=1500  # the pure run takes 7-13 minutes beside the other
JOBS_BOUND_SECONDS=2700  # the multiprocess run takes 13-20 minutes
pure_log="$(mktemp)"
bounded "$PURE_BOUND_SECONDS" -m "not multiprocess or beside" >"$pure_log" 2>&1 &
pure=$!
trap 'kill "$pure" 2>/dev/null || true; rm -f "$pure_log"' EXIT
echo "== tests that start real ranks (the pure tests run beside them; their report follows)"
jobs_status=0
bounded "$JOBS_BOUND_SECONDS" -m "multiprocess and not beside" || jobs_status=$?
if [ "$jobs_status" -eq 124 ]; then
  echo "== the multiprocess tests outlived ${JOBS_BOUND_SECONDS} s and were ended (their stacks are above)"
fi
pure_status=0
wait "$pure" || pure_status=$?
echo "== pure tests"
cat "$pure_log"
if [ "$pure_status" -eq 124 ]; then
  echo "== the pure tests outlived ${PURE_BOUND_SECONDS} s and were ended (their stacks are above)"
fi
echo "== multiprocess tests: exit $jobs_status; pure tests: exit $pure_status"
if [ "$jobs_status" -ne 0 ]; then exit "$jobs_status"; fi
exit "$pure_status"
