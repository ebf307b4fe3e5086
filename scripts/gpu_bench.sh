#!/usr/bin/env bash
# Issue 41 on one GPU, in at most 200 s of wall time: the GPU tests of the W path and the memory
# governor (tests/engine/test_gpu_weight_path.py), what the engine's cost profiler and memory
# governor measure against CUDA events and the allocator, plans from those costs, and bf16 against
# stock DeepSpeed (bench/gpu_costs.py), then decoupled backprop on GPT-3- and LLaMA-family stages
# (bench/backward_split.py, with whatever time is left).
#
#   bash scripts/gpu_bench.sh               on a machine with a CUDA device (without one: says so, exits 0)
#   bash scripts/gpu_bench.sh --cpu-smoke   the same three parts at CPU sizes (to test this script)
#
# It installs nothing: torch, pytest and transformers must be importable, and DeepSpeed and mip too
# (the caller installs their wheels or puts them on PYTHONPATH first). The repository root is put
# in front of PYTHONPATH, so ds_recycle need not be installed. PYTHON: the interpreter (default
# python3; with --cpu-smoke, .venv/bin/python when present). DS_ACCELERATOR must be unset or cuda
# (DeepSpeed's CPU accelerator compiles an op at start-up); it is set to cuda. Each part prints
# one line per measurement; a part that fails or runs out of time adds a FAILED line, and the
# script goes on and exits 0. GPU_BENCH_LOG_DIR (default: a temporary folder) keeps a copy of
# the output (gpu_bench.out) and each part's stderr, whose last lines are shown when the part fails.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TOTAL_SECONDS=200
SAFETY_SECONDS=10  # kept free of every bound: start-up of each part, a kill's grace, this script's own lines
MODE=gpu
if [ "${1:-}" = "--cpu-smoke" ]; then
  MODE=cpu
elif [ "$#" -gt 0 ]; then
  echo "usage: bash scripts/gpu_bench.sh [--cpu-smoke]" >&2
  exit 2
fi
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ "$MODE" = cpu ] && [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON="$ROOT/.venv/bin/python"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1  # unbuffered: a part ended by its bound keeps every line it printed
LOG_DIR="${GPU_BENCH_LOG_DIR:-$(mktemp -d -t gpu_bench.XXXXXX)}"
mkdir -p "$LOG_DIR"
SUMMARY=()

# run NAME SECONDS CMD...: run CMD bounded by SECONDS, its stdout as it comes, its stderr in the log
# folder; a FAILED line when it fails or times out.
run() {
  local name="$1" seconds="$2"
  shift 2
  local log="$LOG_DIR/$name.stderr" rc=0 started=$SECONDS
  echo "== $name (bound ${seconds} s)"
  timeout --kill-after=2 "$seconds" "$@" 2>"$log" || rc=$?
  local took=$((SECONDS - started))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("$name: ok in ${took} s")
    return 0
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "FAILED: $name timed out after ${seconds} s (its lines so far are above)"
  else
    echo "FAILED: $name exited with $rc after ${took} s"
  fi
  echo "  last lines of its stderr ($log):"
  grep -v '^\[20[0-9][0-9]-' "$log" | tail -n 12 | sed 's/^/  | /'
  SUMMARY+=("$name: FAILED (exit $rc) in ${took} s")
}

# The seconds left of TOTAL_SECONDS, less RESERVE for the parts after this one.
left() {
  local remaining=$((TOTAL_SECONDS - SAFETY_SECONDS - SECONDS - $1))
  [ "$remaining" -lt 1 ] && remaining=1
  echo "$remaining"
}
bounded() {  # bounded WANTED RESERVE: WANTED seconds, or fewer when fewer are left
  local wanted="$1" have
  have=$(left "$2")
  [ "$have" -lt "$wanted" ] && wanted=$have
  echo "$wanted"
}

main() {
  if [ "$MODE" = gpu ]; then
    if [ -n "${DS_ACCELERATOR:-}" ] && [ "$DS_ACCELERATOR" != cuda ]; then
      echo "note: DS_ACCELERATOR=$DS_ACCELERATOR replaced by cuda"
    fi
    export DS_ACCELERATOR=cuda
    local probe check='import torch; c = torch.cuda.is_available()
print(torch.__version__, c, torch.cuda.get_device_name() if c else "-")'
    probe=$(timeout 30 "$PYTHON" -c "$check" 2>"$LOG_DIR/probe.stderr")
    if [ "$(echo "$probe" | awk '{print $2}')" != True ]; then
      echo "no CUDA device seen by $PYTHON (torch: ${probe:-not importable, see $LOG_DIR/probe.stderr}); nothing run"
      echo "gpu_bench: nothing run (no GPU); run 'bash scripts/gpu_bench.sh --cpu-smoke' to test the parts on CPU"
      return 0
    fi
    echo "# gpu_bench: torch $(echo "$probe" | awk '{print $1}') on $(echo "$probe" | cut -d' ' -f3-); logs in $LOG_DIR"
    COSTS_ARGS=(--device cuda)
    SPLIT_ARGS=(--device cuda)
  else
    export DS_ACCELERATOR=cpu
    # DeepSpeed's CPU accelerator compiles its shared-memory op once; bootstrap.sh built it here.
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
    echo "# gpu_bench --cpu-smoke: the GPU parts at CPU sizes with $PYTHON; logs in $LOG_DIR"
    COSTS_ARGS=(--device cpu --smoke)
    SPLIT_ARGS=(--device cpu --suite gpu --tiny)
  fi

  # Bounds: the tests get at most 35 s and gpu_costs 60 s, so that 60 s or more are left for
  # backward_split, which gets the rest (its own budget stops starting stages 20 s before its bound).
  # --noconftest: tests/conftest.py needs hypothesis and psutil, which these tests do not.
  run gpu-tests "$(bounded 35 120)" "$PYTHON" -m pytest -q -rs --tb=short -p no:cacheprovider --noconftest \
    tests/engine/test_gpu_weight_path.py
  run gpu-costs "$(bounded 60 60)" "$PYTHON" bench/gpu_costs.py "${COSTS_ARGS[@]}"
  local split_seconds split_budget
  split_seconds=$(left 0)
  split_budget=$((split_seconds - 20))
  [ "$split_budget" -lt 1 ] && split_budget=1
  run backward-split "$split_seconds" "$PYTHON" bench/backward_split.py "${SPLIT_ARGS[@]}" \
    --budget-seconds "$split_budget"

  echo "== gpu_bench summary (${SECONDS} s of ${TOTAL_SECONDS} s)"
  for line in "${SUMMARY[@]}"; do
    echo "  $line"
  done
}

main | tee "$LOG_DIR/gpu_bench.out"
exit 0
